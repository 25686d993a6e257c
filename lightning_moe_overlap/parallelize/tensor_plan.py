"""Tensor and sequence parallelism of the dense layers on torch's engine (``parallelize_module`` over ``mesh["tp"]``).

The layout, Megatron's with sequence parallelism and expert tensor parallelism 1 (torchtitan's ``etp=1``):

- attention (and dense MLPs) are tensor-parallel: the query / key / value (gate / up) projections column-wise, the
  output (down) projection row-wise, so each tp rank computes ``heads / tp`` heads;
- between them the activations are sequence-parallel: the output projection reduce-scatters onto the sequence
  dimension, the norms, the residual adds and the **MoE blocks** run on the rank's ``S / tp`` tokens, and the next
  attention all-gathers its input. Each tp rank therefore routes and dispatches its own tokens: the experts are not
  tensor-sharded, and the ep groups fold over tp ranks (``parallel/dims.py``);
- the LM head is column-wise (vocabulary-parallel) and keeps its logits vocabulary-sharded: a ``Shard(-1)``
  ``DTensor`` of the whole ``[B, S, V]`` shape holding ``V / tp`` columns, whose cross-entropy runs over the shards
  under torch's ``loss_parallel`` (entered by the strategy around each step, ``loss/vocab_parallel.py``).

Gradients. A parameter the plan shards is a ``DTensor`` over tp and gets its gradient from torch's engine. Every other
dense parameter (norms, routers, shared experts, per-head ``q_norm``) is a replica on the tp ranks that sees only
the rank's tokens (or heads), so its full gradient is the **sum** over tp of the local ones (Megatron's
``sequence_parallel`` parameters): :class:`TensorParallelGrads` sums them once per step, before the data-parallel
reduction. A plan must therefore leave no replicated parameter in a region where the activations are replicated over
tp (the plans here keep that contract; a user's plan must too, docs/tensor_parallel.md).

Plans. A LightningModule may return its own from ``tensor_parallel_plan(self, tp_mesh)`` (``MoEGPT`` does); for a
Hugging Face v5 model the plan is derived from the one the model carries (``base_model_tp_plan``, attention and dense
MLP entries; the MoE entries are left out), see :func:`hf_tensor_parallel_plan`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

from lightning_moe_overlap.moe.adapters import find_experts
from lightning_moe_overlap.moe.ep import ExpertParallelExperts
from lightning_moe_overlap.moe.router import TopKRouter
from lightning_moe_overlap.parallel.grads import allreduce_mean, materialised_grads
from lightning_moe_overlap.parallel.tp_styles import WHOLE_GRADIENT_ATTR, WholeGradientReplica, vocab_parallel_head

PLAN_HOOK = "tensor_parallel_plan"  # LightningModule method: tensor_parallel_plan(tp_mesh) -> {fqn pattern: style}


class TensorParallelPlanError(ValueError):
    """A model whose tensor-parallel plan cannot be built or applied; the message names the value, rule and fix."""


def set_sequence_group(module: nn.Module, group: ProcessGroup) -> None:
    """Give every ``TopKRouter`` of ``module`` the group holding the other parts of its sequences: its balancing loss
    then counts the whole sequence's tokens, and the per-rank losses add up to the unsplit model's."""
    for router in module.modules():
        if isinstance(router, TopKRouter):
            router.sequence_group = group


def plan_of(module: nn.Module, tp_mesh: DeviceMesh) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of a LightningModule: its ``tensor_parallel_plan(tp_mesh)`` hook, else the plan of
    every Hugging Face v5 decoder LM inside it (:func:`hf_tensor_parallel_plan`).

    Raises:
        TensorParallelPlanError: the module has neither (or an HF model the plan cannot cover).
    """
    hook = getattr(module, PLAN_HOOK, None)
    if callable(hook):
        return dict(hook(tp_mesh))
    plan: dict[str, ParallelStyle] = {}
    found = _hf_causal_lms(module)
    for prefix, hf_model in found:
        plan.update(hf_tensor_parallel_plan(hf_model, tp_mesh.size(), prefix=prefix))
    if not found:
        raise TensorParallelPlanError(
            f"`MoEOverlapStrategy(tp={tp_mesh.size()})`: `{type(module).__name__}` has no tensor-parallel plan: it "
            f"defines no `{PLAN_HOOK}(self, tp_mesh)` method and holds no Hugging Face causal LM whose plan could be "
            "used. Rule: tp > 1 shards the attention and dense layers by a plan. Fix: define "
            f"`{PLAN_HOOK}` returning {{module name pattern: torch ParallelStyle}} (docs/tensor_parallel.md), or "
            "use tp=1."
        )
    return plan


def hf_tensor_parallel_plan(hf_model: nn.Module, tp: int, *, prefix: str = "") -> dict[str, ParallelStyle]:
    """The plan of a Hugging Face v5 causal LM (``XForCausalLM``) at ``prefix``, from the plan the model carries
    (``config.base_model_tp_plan``), with sequence parallelism between the attention blocks:

    - ``embed_tokens`` row-wise (vocabulary-parallel, output replicated: HF builds the causal mask and positions
      from it);
    - the first decoder layer's input cut onto the sequence dimension; every ``self_attn`` (and dense ``mlp``)
      gathers its input, its column-wise entries of the model's plan stay column-wise, its row-wise ones
      reduce-scatter onto the sequence;
    - ``lm_head`` column-wise with the logits left vocabulary-sharded (a ``Shard(-1)`` ``DTensor``: HF's loss runs
      over the shards under ``loss_parallel``; no rank holds the ``[B, S, V]`` logits);
    - the model's entries inside MoE blocks (experts, router, shared experts) are left out: experts are
      expert-parallel, the rest sequence-parallel replicas.

    Raises:
        TensorParallelPlanError: tp does not divide the attention heads, key/value heads or a dense MLP's width;
            tied input and output embeddings; or a plan style this function does not map.
    """
    config = hf_model.config
    base_name = getattr(hf_model, "base_model_prefix", "model")
    base = getattr(hf_model, base_name, None)
    layers = getattr(base, "layers", None)
    if base is None or layers is None:
        raise TensorParallelPlanError(
            f"`hf_tensor_parallel_plan`: `{type(hf_model).__name__}` has no `{base_name}.layers`; only decoder LMs "
            "laid out as HF's causal LMs are planned. Fix: define `tensor_parallel_plan` on the LightningModule."
        )
    _check_divides(config, tp, type(hf_model).__name__)
    if getattr(config, "tie_word_embeddings", False):
        raise TensorParallelPlanError(
            f"`hf_tensor_parallel_plan`: `{type(hf_model).__name__}` ties its input and output embeddings "
            "(tie_word_embeddings=True), and tensor parallelism shards the embedding by rows and the LM head by "
            "vocabulary columns of one shared tensor differently. Fix: tp=1 for this model, or untie the embeddings."
        )
    moe_paths = _moe_paths(base)
    out: dict[str, ParallelStyle] = {}
    root = f"{prefix}{base_name}."
    out[f"{root}embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    out[f"{root}layers.0"] = PrepareModuleInput(
        input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
    )
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    names = [name for name, _ in base.named_modules()]
    for pattern, style in plan.items():
        for name in fnmatch.filter(names, pattern):
            if any(name == p or name.startswith(p + ".") for p in moe_paths):
                continue
            mapped = _hf_style(style, name, type(hf_model).__name__, config)
            if mapped is not None:
                out[root + name] = mapped
            if style == "mla_kv_a_proj":  # the latent attention's other down-projection parts (WholeGradientReplica)
                parent = name.rsplit(".", 1)[0]
                for sibling in _MLA_WHOLE_GRADIENT:
                    if f"{parent}.{sibling}" in names:
                        out[f"{root}{parent}.{sibling}"] = WholeGradientReplica()
    inside = [name[len(root):] for name in out if name.startswith(root + "layers.")]
    planned = [name for name in inside if name.count(".") >= 3]  # layers.L.block.proj
    for parent in sorted({name.rsplit(".", 1)[0] for name in planned}):  # each planned block gathers its input
        out[root + parent] = _gather_input(type(base.get_submodule(parent)).__name__)
    out[f"{prefix}lm_head"] = vocab_parallel_head()
    return out


def _gather_input(class_name: str) -> PrepareModuleInput:
    """Gather a block's sequence-parallel input: HF decoder layers call attention with ``hidden_states=`` and the
    MLP with it as the first positional argument."""
    if "Attention" in class_name:
        return PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=True,
        )
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)


_MLA_WHOLE_GRADIENT = ("q_a_proj", "q_a_layernorm", "kv_a_layernorm")  # before the column-wise up-projections


def _hf_style(style: str, name: str, owner: str, config: object) -> ParallelStyle | None:
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel(output_layouts=Shard(1))
    if style == "mla_kv_a_proj":
        rope_dim = getattr(config, "qk_rope_head_dim", None)
        if not isinstance(rope_dim, int) or rope_dim < 1:
            raise TensorParallelPlanError(
                f"`hf_tensor_parallel_plan`: `{owner}` plans `{name}` as 'mla_kv_a_proj' (multi-head latent "
                f"attention) but its config has qk_rope_head_dim={rope_dim!r}. Rule: the rotary key columns of that "
                "projection, config.qk_rope_head_dim of them, get their gradient summed over tp. Fix: set "
                "qk_rope_head_dim in the config, or define `tensor_parallel_plan` on the LightningModule."
            )
        return WholeGradientReplica(rope_dim=rope_dim)
    if style in ("replicated_with_grad_allreduce", "replicate", "local"):
        return None  # a per-head or per-token replica: its gradient is summed over tp (TensorParallelGrads)
    raise TensorParallelPlanError(
        f"`hf_tensor_parallel_plan`: `{owner}` plans `{name}` as {style!r}, a style this package does not map "
        "(it maps 'colwise', 'rowwise', 'mla_kv_a_proj' and the replicated ones). Fix: define "
        "`tensor_parallel_plan` on the LightningModule with torch ParallelStyles for this model."
    )


def _check_divides(config: object, tp: int, owner: str) -> None:
    sizes = {
        "num_attention_heads": getattr(config, "num_attention_heads", None),
        "num_key_value_heads": getattr(config, "num_key_value_heads", None),
        "intermediate_size": getattr(config, "intermediate_size", None),
    }
    bad = {k: v for k, v in sizes.items() if isinstance(v, int) and v % tp}
    if bad:
        raise TensorParallelPlanError(
            f"`MoEOverlapStrategy(tp={tp})`: `{owner}` has {', '.join(f'{k}={v}' for k, v in bad.items())}, which "
            f"tp={tp} does not divide. Rule: each tp rank computes heads / tp attention heads (and width / tp of a "
            "dense MLP). Fix: choose tp among the common divisors of these sizes."
        )


def _moe_paths(base: nn.Module) -> list[str]:
    """The names (in ``base``) of every MoE block's parent module, i.e. where the experts sit (``layers.1.mlp``)."""
    paths = []
    for name in find_experts(base):
        paths.append(name.rsplit(".", 1)[0] if "." in name else name)
    for name, sub in base.named_modules():
        if isinstance(sub, ExpertParallelExperts):
            paths.append(name.rsplit(".", 1)[0])
    return paths


def _hf_causal_lms(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(prefix, model)`` of every Hugging Face causal LM (an ``lm_head`` beside a base model with ``layers``) in
    ``module``, outermost only."""
    found: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        if any(name.startswith(p) for p, _ in found if p):
            continue
        if hasattr(sub, "config") and hasattr(sub, "lm_head") and hasattr(sub, "base_model_prefix"):
            found.append((f"{name}." if name else "", sub))
    return found


# -- gradients of the replicas ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorParallelGrads:
    """The dense parameters the plan left whole (by name in the model), whose gradients are summed over ``group``.

    Names, not tensors: ``fully_shard`` replaces the parameters after the plan is applied, and during a step the
    module holds the gathered ones, whose gradients are the ones to sum (before FSDP reduces over dp x cp).

    With ``overlap_grad_reduce`` each FSDP unit's replicas are summed just before the unit's early reduction
    (:meth:`reduce_unit`, where that reduction runs); :meth:`reduce` then sums the ones left, at the end of the
    step."""

    names: tuple[str, ...]
    group: ProcessGroup
    _summed: set[int] = field(default_factory=set, compare=False, repr=False)  # ids summed early in this step

    @classmethod
    def of(cls, model: nn.Module, group: ProcessGroup, held: Sequence[nn.Module] | None = None) -> TensorParallelGrads:
        """Every trainable parameter of ``model`` (of the ``held`` modules in it when given: a rank's pipeline
        chunks) that is neither a ``DTensor`` (planned, or an expert) nor inside an expert-parallel experts module or
        a :class:`WholeGradientReplica` (its gradient is whole on every tp rank already)."""
        not_summed = {id(p) for m in model.modules() if isinstance(m, ExpertParallelExperts) for p in m.parameters()}
        not_summed |= {id(p) for m in model.modules() if getattr(m, WHOLE_GRADIENT_ATTR, False) for p in m.parameters()}
        mine = None if held is None else {id(p) for m in held for p in m.parameters()}
        names = tuple(
            name for name, p in model.named_parameters()
            if p.requires_grad and not isinstance(p, DTensor) and id(p) not in not_summed
            and (mine is None or id(p) in mine)
        )  # fmt: skip
        return cls(names, group)

    def reduce(self, model: nn.Module) -> None:
        """Sum the gradients of :attr:`names` over the tp group, those :meth:`reduce_unit` summed in this step
        excepted (collective; a missing gradient counts as zeros, so every rank reduces the same buffers):
        ``parallel/grads.py``'s bucketed all-reduce, divided by 1."""
        params = [p for p in (model.get_parameter(name) for name in self.names) if id(p) not in self._summed]
        self._summed.clear()
        if params:
            allreduce_mean(materialised_grads(params), self.group, 1)

    def unit_reducer(self, model: nn.Module, group: ProcessGroup) -> Callable[[list[Tensor]], None]:
        """The ``before_reduce`` of ``overlap_grad_reduce``'s early reductions (``parallel/grad_reduce.py``): sums
        the replicas among an FSDP unit's gathered parameters over ``group`` (the tp ranks, a communicator of its
        own: on gloo the reduction lane issues these sums while the backward issues the plan's tp collectives on
        :attr:`group`), before the unit's reduction over dp x cp. Every rank of the tp group reduces the same units
        in the same order, so the collectives pair up."""

        def reduce_unit(params: list[Tensor]) -> None:
            replicas = {id(model.get_parameter(name)) for name in self.names}
            mine = [p for p in params if id(p) in replicas]
            if mine:
                allreduce_mean(materialised_grads(mine), group, 1)
                self._summed.update(id(p) for p in mine)

        return reduce_unit
