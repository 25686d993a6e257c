"""The names the memory callbacks accept, and how they map onto the decoder layers of a model.

A *layer* is a decoder layer recognised by a registered spec. A spec maps each name to a *target* inside the layer:

- ``"path.to.module"`` or a tuple of paths: sub-modules (missing paths are skipped);
- :class:`SDPACall`: the ``torch.nn.functional.scaled_dot_product_attention`` call made inside a sub-module (the
  core attention is a function call, not a module, in this package's layers and in HF's ``sdpa`` attention);
- :class:`ExpertStage`: a stage of an :class:`~lightning_moe_overlap.moe.ep.ExpertParallelExperts` (the experts
  once the strategy made them expert-parallel): ``"local"`` (the expert MLP between dispatch and combine),
  ``"fc1"`` (its first projection), ``"act"`` (its activation), ``"input"`` (the dispatched rows, a tensor tag);
- :class:`Output`: a tensor tag, the output of a sub-module;
- a callable ``fn(layer) -> target | module | list of modules | None``: chosen per layer (``None``: not there).

Built in: this package's decoder layer (``attn_norm``, ``attn``, ``mlp_norm``, ``mlp``) and the Hugging Face v5
pre-norm decoder layers (``input_layernorm``, ``self_attn``, ``post_attention_layernorm``, ``mlp``: Qwen2/3-MoE,
Mixtral, OLMoE, DeepSeek-V2/V3, ...). Other layers: :func:`register_layer_names`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from torch import nn

from lightning_moe_overlap.moe.ep import ExpertParallelExperts
from lightning_moe_overlap.registry import Registry

# Megatron / LoongForge names (``--recompute-modules``, ``--offload-modules``, ``--offload-tensors``).
RECOMPUTE_NAMES: tuple[str, ...] = (
    "core_attn", "mlp", "moe", "moe_act", "shared_experts", "routed_experts", "layernorm", "mla_up_proj",
    "a2a_overlap_attn", "a2a_overlap_post_attn", "a2a_overlap_mlp",
)
OFFLOAD_MODULE_NAMES: tuple[str, ...] = ("attn_norm", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")
OFFLOAD_TENSOR_NAMES: tuple[str, ...] = ("dispatched_input", "pre_mlp_layernorm_output")

Stage = Literal["local", "fc1", "act", "input"]


@dataclass(frozen=True)
class SDPACall:
    """The ``scaled_dot_product_attention`` call(s) inside the sub-module at ``path``."""

    path: str


@dataclass(frozen=True)
class ExpertStage:
    """A stage of the expert-parallel experts module at ``path`` (see the module docstring)."""

    path: str
    stage: Stage


@dataclass(frozen=True)
class Output:
    """Tensor tag: the output of the sub-module at ``path``."""

    path: str


Target = str | tuple[str, ...] | SDPACall | ExpertStage | Output | Callable[[nn.Module], "Target | None"]


# -- resolved targets: what one name means in one layer ---------------------------------------------------------
@dataclass(frozen=True)
class ModuleRegion:
    module: nn.Module


@dataclass(frozen=True)
class CallRegion:
    module: nn.Module


@dataclass(frozen=True)
class StageRegion:
    experts: ExpertParallelExperts
    stage: Stage


@dataclass(frozen=True)
class OutputTag:
    module: nn.Module


Region = ModuleRegion | CallRegion | StageRegion | OutputTag


@dataclass(frozen=True)
class LayerSpec:
    """How names map onto one kind of layer."""

    name: str
    matches: Callable[[nn.Module], bool]
    targets: Mapping[str, Target]


def _has(*names: str) -> Callable[[nn.Module], bool]:
    def matches(module: nn.Module) -> bool:
        children = dict(module.named_children())
        return all(name in children for name in names)

    return matches


def _first_of(*paths: str) -> Callable[[nn.Module], Target | None]:
    def pick(layer: nn.Module) -> Target | None:
        return next((p for p in paths if _submodule(layer, p) is not None), None)

    return pick


def _moe_block(path: str) -> Callable[[nn.Module], Target | None]:
    """``path`` when that block holds an experts module (an MoE block), else nothing (a dense MLP)."""

    def pick(layer: nn.Module) -> Target | None:
        from lightning_moe_overlap.moe.adapters import adapter_for

        experts = _submodule(layer, f"{path}.experts")
        if experts is None:
            return None
        return path if isinstance(experts, ExpertParallelExperts) or adapter_for(experts) else None

    return pick


def _decoder_targets(attn: str, attn_norm: str, mlp_norm: str, attn_proj: str) -> dict[str, Target]:
    experts = "mlp.experts"
    return {
        "core_attn": SDPACall(attn),
        "mlp": "mlp",
        "moe": _moe_block("mlp"),
        "moe_act": ExpertStage(experts, "act"),
        "shared_experts": _first_of("mlp.shared_stage", "mlp.shared_experts", "mlp.shared_expert"),  # moe/shared.py
        "routed_experts": experts,
        "layernorm": (attn_norm, mlp_norm),
        "mla_up_proj": (f"{attn}.q_b_proj", f"{attn}.kv_b_proj"),
        "a2a_overlap_attn": (attn_norm, attn),
        "a2a_overlap_post_attn": (mlp_norm, "mlp.gate"),
        "a2a_overlap_mlp": ExpertStage(experts, "local"),
        "attn_norm": attn_norm,
        "attn_proj": attn_proj,
        "mlp_norm": mlp_norm,
        "expert_fc1": ExpertStage(experts, "fc1"),
        "dispatched_input": ExpertStage(experts, "input"),
        "pre_mlp_layernorm_output": Output(mlp_norm),
    }


OWN_LAYER = LayerSpec(
    "lightning_moe_overlap", _has("attn_norm", "attn", "mlp_norm", "mlp"),
    _decoder_targets("attn", "attn_norm", "mlp_norm", "attn.proj"),
)
HF_LAYER = LayerSpec(
    "transformers_v5", _has("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"),
    _decoder_targets("self_attn", "input_layernorm", "post_attention_layernorm", "self_attn.o_proj"),
)
LAYER_SPECS = Registry("spec", (OWN_LAYER, HF_LAYER), ("register_layer_names", "unregister_layer_names"))


def register_layer_names(
    layer_type: type[nn.Module] | Callable[[nn.Module], bool], names: Mapping[str, Target], *, name: str | None = None
) -> LayerSpec:
    """Map names (built-in or new ones) onto the sub-modules or tensors of a kind of decoder layer.

    Used by :class:`~lightning_moe_overlap.callbacks.SelectiveRecompute` (module names) and
    :class:`~lightning_moe_overlap.callbacks.ActivationOffload` (module and tensor names). For a layer several
    specs match, later registrations win name by name over earlier ones and over the built-in specs. The specs
    are process-wide (see ``registry.py``); ``with LAYER_SPECS.scoped(): ...`` undoes registrations on exit.

    Args:
        layer_type: the layer class (instances of subclasses match too) or a predicate on modules.
        names: ``{name: target}``; a target is a dotted path relative to the layer, a tuple of paths,
            :class:`SDPACall`, :class:`ExpertStage`, :class:`Output`, or ``fn(layer) -> target | None``.
        name: a unique name for the spec (defaults to the class name).

    Returns:
        The spec; pass it to :func:`unregister_layer_names` to remove it.

    Raises:
        TypeError: ``layer_type`` is neither a module class nor a callable, or a target has the wrong type.
        ValueError: ``name`` is already registered.

    Example::

        register_layer_names(MyBlock, {"core_attn": SDPACall("attention"), "mlp_norm": "norm2",
                                       "pre_mlp_layernorm_output": Output("norm2")})
    """
    if isinstance(layer_type, type) and issubclass(layer_type, nn.Module):
        matches: Callable[[nn.Module], bool] = lambda m, cls=layer_type: isinstance(m, cls)
        default_name = layer_type.__qualname__
    elif callable(layer_type):
        matches, default_name = layer_type, getattr(layer_type, "__qualname__", "layer predicate")
    else:
        raise TypeError(
            f"`register_layer_names`: layer_type={layer_type!r} must be an `nn.Module` subclass or a predicate "
            "`fn(module) -> bool`. Pass the class of your decoder layer."
        )
    for key, target in names.items():
        _check_target(key, target)
    fix = "Pass `name=...`, or `unregister_layer_names(...)` the old one first."
    return LAYER_SPECS.add(LayerSpec(name or default_name, matches, dict(names)), fix=fix)


def unregister_layer_names(spec: LayerSpec | str) -> None:
    """Remove a spec added by :func:`register_layer_names` (by the spec or its name)."""
    LAYER_SPECS.remove(spec if isinstance(spec, str) else spec.name)


def _check_target(key: str, target: object) -> None:
    if isinstance(target, tuple) and all(isinstance(p, str) for p in target):
        return
    if isinstance(target, (str, SDPACall, ExpertStage, Output)) or callable(target):
        return
    raise TypeError(
        f"`register_layer_names`: the target of {key!r} is {target!r}; a target must be a dotted path, a tuple of "
        "paths, SDPACall, ExpertStage, Output or a callable `fn(layer) -> target | None`."
    )


def user_names() -> set[str]:
    """Names only user specs define (valid for both callbacks, as modules or tensors by their target)."""
    builtin = {key for spec in LAYER_SPECS.builtin for key in spec.targets}
    return {key for spec in LAYER_SPECS.user for key in spec.targets} - builtin


# -- layers of a model -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layer:
    """One decoder layer of a model and its name -> target map."""

    qualname: str
    module: nn.Module
    targets: Mapping[str, Target]

    def resolve(self, name: str) -> list[Region]:
        """What ``name`` means in this layer; empty when the layer does not have it."""
        target = self.targets.get(name)
        return [] if target is None else _resolve(self.module, target)


def find_layers(model: nn.Module) -> list[Layer]:
    """The decoder layers of ``model`` in model order (the outermost match; matched layers are not searched)."""
    found: list[Layer] = []
    _walk(model, "", found)
    return found


def _walk(parent: nn.Module, prefix: str, found: list[Layer]) -> None:
    for attr, child in parent.named_children():
        qualname = f"{prefix}{attr}"
        specs = [s for s in (*LAYER_SPECS.builtin, *LAYER_SPECS.user) if s.matches(child)]
        if specs:
            merged: dict[str, Target] = {}
            for spec in specs:  # built-in first, then user specs in registration order: later ones win
                merged.update(spec.targets)
            found.append(Layer(qualname, child, merged))
        else:
            _walk(child, f"{qualname}.", found)


def _submodule(layer: nn.Module, path: str) -> nn.Module | None:
    try:
        return layer.get_submodule(path)
    except AttributeError:
        return None


def _resolve(layer: nn.Module, target: Target) -> list[Region]:
    if isinstance(target, str):
        module = _submodule(layer, target)
        return [] if module is None else [ModuleRegion(module)]
    if isinstance(target, tuple):
        return [region for path in target for region in _resolve(layer, path)]
    if isinstance(target, SDPACall):
        module = _submodule(layer, target.path)
        return [] if module is None else [CallRegion(module)]
    if isinstance(target, ExpertStage):
        module = _submodule(layer, target.path)
        return [StageRegion(module, target.stage)] if isinstance(module, ExpertParallelExperts) else []
    if isinstance(target, Output):
        module = _submodule(layer, target.path)
        return [] if module is None else [OutputTag(module)]
    picked = target(layer)
    if picked is None:
        return []
    if isinstance(picked, nn.Module):
        return [ModuleRegion(picked)]
    if isinstance(picked, (list, tuple)) and all(isinstance(m, nn.Module) for m in picked):
        return [ModuleRegion(m) for m in picked]
    return _resolve(layer, picked)


def present_names(layers: Iterable[Layer], names: Iterable[str]) -> list[str]:
    """The names among ``names`` that resolve to something in at least one layer."""
    layers = list(layers)
    return [n for n in names if any(layer.resolve(n) for layer in layers)]


def is_tensor_name(layers: Iterable[Layer], name: str) -> bool:
    """Whether ``name`` is a tensor tag (resolves to a tag) in these layers."""
    return any(
        isinstance(r, OutputTag) or (isinstance(r, StageRegion) and r.stage == "input")
        for layer in layers
        for r in layer.resolve(name)
    )
