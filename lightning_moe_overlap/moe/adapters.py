"""Find the experts modules of any model, and make them expert-parallel in place.

An *adapter* recognises one kind of experts module and describes its storage (:class:`ExpertsLayout`). Built in:

- ``lightning_moe_overlap``: this package's :class:`~lightning_moe_overlap.moe.experts.Experts`;
- ``transformers_v5``: Hugging Face transformers v5 experts modules, matched by structure: 3-D ``gate_up_proj``
  (or ``up_proj``) and ``down_proj`` parameters with the same number of experts, an ``act_fn`` (or its own
  ``_apply_gate``), and a
  ``forward(hidden_states, top_k_index, top_k_weights)``. The flags HF sets with ``use_experts_implementation``
  (``is_transposed``, ``has_bias``, ``has_gate``) and a custom ``_apply_gate`` are honoured, which covers
  Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V2/V3, GPT-OSS, Nemotron-H and the other v5 MoE models.

Other blocks: :func:`register_experts_adapter` (user adapters are tried before the built-in ones).

:func:`apply_expert_parallel` swaps each experts module found for an
:class:`~lightning_moe_overlap.moe.ep.ExpertParallelExperts` (``setattr`` on its parent); routers, shared
experts and everything else are left as they are.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from lightning_moe_overlap.moe.capacity import DropPolicy, validate_capacity
from lightning_moe_overlap.moe.dispatch.base import check_expert_split
from lightning_moe_overlap.moe.dispatch.comm import group_size
from lightning_moe_overlap.moe.dispatch.deepep_buffers import DeepEPBuffers
from lightning_moe_overlap.moe.dispatch.factory import build_dispatcher
from lightning_moe_overlap.moe.ep import ExpertParallelExperts
from lightning_moe_overlap.moe.experts import Experts
from lightning_moe_overlap.moe.grouped import GemmImpl
from lightning_moe_overlap.moe.te_backend import ExpertBackend
from lightning_moe_overlap.moe.layer import MoELayer
from lightning_moe_overlap.moe.layout import ExpertsLayout, method_without_weights
from lightning_moe_overlap.moe.layout_check import check_layout_math, check_layout_tensors
from lightning_moe_overlap.moe.shared import overlap_shared_experts
from lightning_moe_overlap.overlap.runtime import CommRuntime
from lightning_moe_overlap.registry import Registry


@dataclass(frozen=True)
class ExpertsAdapter:
    """Recognises one kind of experts module.

    Attributes:
        name: unique name (shown in errors and introspection).
        matches: ``True`` for the modules this adapter handles.
        layout: the module's :class:`ExpertsLayout`; may raise ``NotImplementedError`` for variants it cannot
            shard.
    """

    name: str
    matches: Callable[[nn.Module], bool]
    layout: Callable[[nn.Module], ExpertsLayout]


@dataclass(frozen=True)
class FoundExperts:
    """One experts module found in a model."""

    name: str
    module: nn.Module
    parent: nn.Module
    attr: str
    adapter: ExpertsAdapter
    num_experts: int


# -- built-in adapters -----------------------------------------------------------------------------------------
def _own_layout(module: nn.Module) -> ExpertsLayout:
    return ExpertsLayout(act_fn=module.act_fn)


def _is_3d_param(value: Any) -> bool:
    return isinstance(value, nn.Parameter) and value.dim() == 3


def _takes_routing(module: nn.Module) -> bool:
    """``forward(hidden_states, top_k_index, top_k_weights)``: at least three positional parameters."""
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3


def _hf_up_name(module: nn.Module) -> str | None:
    for name in ("gate_up_proj", "up_proj"):
        if _is_3d_param(getattr(module, name, None)):
            return name
    return None


def _hf_matches(module: nn.Module) -> bool:
    if isinstance(module, (ExpertParallelExperts, Experts)):
        return False
    up_name = _hf_up_name(module)
    down = getattr(module, "down_proj", None)
    if up_name is None or not _is_3d_param(down):
        return False
    if not callable(getattr(module, "act_fn", None)) and not _has_custom_apply_gate(module):
        return False  # neither an activation nor its own gate: not an experts module we can compute
    up = getattr(module, up_name)
    return up.shape[0] == down.shape[0] and _takes_routing(module)


def _hf_layout(module: nn.Module) -> ExpertsLayout:
    if getattr(module, "has_post_expert_norm", False):
        raise NotImplementedError(
            f"`{type(module).__name__}` applies a norm after each expert (has_post_expert_norm=True), which the "
            "expert-parallel experts do not compute. Register an adapter for it (docs/adapters.md) or keep ep=1."
        )
    up_name = _hf_up_name(module)
    assert up_name is not None  # guaranteed by _hf_matches
    gated = bool(getattr(module, "has_gate", up_name == "gate_up_proj"))
    has_bias = bool(getattr(module, "has_bias", False))
    gate_fn = None
    if gated and _has_custom_apply_gate(module):
        gate_fn = method_without_weights(module, "_apply_gate")
    return ExpertsLayout(
        act_fn=getattr(module, "act_fn", None),
        up_name=up_name,
        down_name="down_proj",
        up_bias_name=f"{up_name}_bias" if has_bias else None,
        down_bias_name="down_proj_bias" if has_bias else None,
        transposed=bool(getattr(module, "is_transposed", False)),
        gated=gated,
        gate_fn=gate_fn,
    )


def _has_custom_apply_gate(module: nn.Module) -> bool:
    """A gate other than transformers' default ``act(gate) * up`` on a ``[gate; up]`` layout."""
    method = getattr(type(module), "_apply_gate", None)
    if method is None:
        return False
    return getattr(method, "__module__", "") != "transformers.integrations.moe"


OWN_ADAPTER = ExpertsAdapter(name="lightning_moe_overlap", matches=lambda m: isinstance(m, Experts), layout=_own_layout)
HF_V5_ADAPTER = ExpertsAdapter(name="transformers_v5", matches=_hf_matches, layout=_hf_layout)
ADAPTERS = Registry("adapter", (OWN_ADAPTER, HF_V5_ADAPTER), ("register_experts_adapter", "unregister_experts_adapter"))


# -- registry (process-wide, see registry.py) ------------------------------------------------------------------
def register_experts_adapter(
    name: str,
    matches: Callable[[nn.Module], bool],
    layout: Callable[[nn.Module], ExpertsLayout],
) -> ExpertsAdapter:
    """Teach :func:`find_experts` and :func:`apply_expert_parallel` a new kind of experts module.

    The module must have the experts interface: per-expert weights as parameters whose first dimension is the
    expert, and ``forward(hidden_states_TD, top_k_index_TK, top_k_weights_TK) -> out_TD``. User adapters are
    tried before the built-in ones, newest first. ``with ADAPTERS.scoped(): ...`` undoes registrations on exit.

    Args:
        name: a unique name.
        matches: returns ``True`` for modules of this kind.
        layout: returns the module's :class:`ExpertsLayout` (parameter names, transposition, gating).

    Returns:
        The registered adapter (pass its ``name`` to :func:`unregister_experts_adapter` to remove it).

    Raises:
        ValueError: ``name`` is already registered.
        TypeError: ``matches`` or ``layout`` is not callable.
    """
    if not callable(matches) or not callable(layout):
        raise TypeError(
            f"`register_experts_adapter`: matches={type(matches).__name__} and layout={type(layout).__name__} "
            "must both be callables taking the module. Pass functions."
        )
    fix = f"Pick another name, or `unregister_experts_adapter({name!r})` first."
    return ADAPTERS.add(ExpertsAdapter(name=name, matches=matches, layout=layout), fix=fix)


def unregister_experts_adapter(name: str) -> None:
    """Remove a user adapter registered with :func:`register_experts_adapter`."""
    ADAPTERS.remove(name)


def registered_adapters() -> tuple[ExpertsAdapter, ...]:
    """Every adapter in the order they are tried."""
    return (*reversed(ADAPTERS.user), *ADAPTERS.builtin)


def adapter_for(module: nn.Module) -> ExpertsAdapter | None:
    """The first adapter that matches ``module``, or ``None``."""
    return next((a for a in registered_adapters() if a.matches(module)), None)


# -- introspection ---------------------------------------------------------------------------------------------
def find_experts(model: nn.Module) -> dict[str, FoundExperts]:
    """Every experts module an adapter recognises, by qualified name, in model order (outermost first).

    Modules nested inside a found experts module are not searched, and already expert-parallel modules are not
    reported.

    Raises:
        TypeError: an adapter's layout names something that is not a tensor of the module it matched (e.g. a
            list of per-expert modules), or projections that are not 3-D.
    """
    found: dict[str, FoundExperts] = {}
    _walk(model, "", found)
    return found


def _walk(parent: nn.Module, prefix: str, found: dict[str, FoundExperts]) -> None:
    for attr, child in parent.named_children():
        name = f"{prefix}{attr}"
        if isinstance(child, ExpertParallelExperts):
            continue
        adapter = adapter_for(child)
        if adapter is None:
            _walk(child, f"{name}.", found)
            continue
        layout = adapter.layout(child)
        check_layout_tensors(name, child, adapter.name, layout)
        num_experts = getattr(child, layout.up_name).shape[0]
        found[name] = FoundExperts(name, child, parent, attr, adapter, num_experts)


def find_moe_blocks(model: nn.Module) -> dict[str, int]:
    """``{experts module name: num_experts}`` for validation before wrapping (e.g. ``num_experts % ep``)."""
    return {name: f.num_experts for name, f in find_experts(model).items()}


def expert_parallel_modules(model: nn.Module) -> list[str]:
    """The names of the experts modules of ``model`` that are already expert-parallel (``apply_expert_parallel`` ran
    on it): :func:`find_experts` does not list them, so a second wrap would find no MoE block."""
    return [name for name, module in model.named_modules() if isinstance(module, ExpertParallelExperts)]


# -- wrapping --------------------------------------------------------------------------------------------------
def _ep_group_of(groups_or_ep_group: Any) -> ProcessGroup | None:
    if groups_or_ep_group is None or isinstance(groups_or_ep_group, ProcessGroup):
        return groups_or_ep_group
    group = getattr(groups_or_ep_group, "ep", None)
    if isinstance(group, ProcessGroup):
        return group
    raise TypeError(
        f"`apply_expert_parallel`: got {type(groups_or_ep_group).__name__} for the groups; expected a "
        "`ParallelGroups` (its `.ep` is used), a `ProcessGroup` (the ep group) or None (single process)."
    )


def apply_expert_parallel(
    model: nn.Module,
    groups_or_ep_group: Any,
    *,
    dispatcher: str = "alltoall",
    runtime: CommRuntime | None = None,
    capacity_factor: float | None = None,
    token_drop_policy: DropPolicy = "probs",
    impl: GemmImpl = "auto",
    expert_backend: ExpertBackend = "torch",
    shared_expert_overlap: bool = False,
    ep_mesh: DeviceMesh | None = None,
    **knobs: Any,
) -> list[ExpertParallelExperts]:
    """Replace every recognised experts module of ``model`` by its expert-parallel version, in place.

    Collective-free (each rank slices its own experts), but every rank of the ep group must call it on the same
    model so their layers line up. Every :class:`~lightning_moe_overlap.moe.layer.MoELayer` parent also gets
    ``runtime`` (for ``shared_expert_overlap``); with ``shared_expert_overlap=True`` every block with shared
    experts runs them inside the dispatch window (``MoELayer``, and HF blocks through ``moe/shared.py``).

    Args:
        model: the user's model.
        groups_or_ep_group: a ``ParallelGroups`` (its ``ep`` is used), the ep ``ProcessGroup``, or ``None``.
        dispatcher: ``"alltoall"``, ``"allgather"`` or ``"flex"``.
        runtime: the strategy's :class:`CommRuntime` (shared by every layer).
        capacity_factor: per-expert capacity factor on local tokens; ``None`` is dropless. The experts drop with it,
            except under a ``MoELayer`` that drops with its own (each layer drops once).
        token_drop_policy: ``"probs"`` or ``"position"``.
        impl: grouped GEMM implementation.
        expert_backend: ``"torch"`` (pure PyTorch GEMMs) or ``"te"`` (Transformer Engine ``GroupedLinear``).
        shared_expert_overlap: run each block's shared experts between issuing the dispatch and waiting on it
            (needs ``runtime``); blocks without shared experts are left as they are.
        ep_mesh: the 1-D ``DeviceMesh`` of the ep group; the expert parameters become ``DTensor``s ``Shard(0)``
            over it (``None``: plain tensors holding the local experts).
        **knobs: dispatcher knobs (see :func:`~lightning_moe_overlap.moe.dispatch.build_dispatcher`). With
            ``dispatcher="flex"`` and no ``deepep_buffers`` / ``deepep_buffer``, one
            :class:`~lightning_moe_overlap.moe.dispatch.DeepEPBuffers` is made here and shared by every layer.

    Returns:
        The new modules, in model order.

    Raises:
        ValueError: a block's ``num_experts`` is not divisible by ep, or its own forward and its layout's math
            disagree on a few test tokens (both checked for every block before any change; see
            :func:`~lightning_moe_overlap.moe.layout_check.check_layout_math`), or a bad capacity setting, or one
            that differs from a ``MoELayer``'s own.
        TypeError: ``groups_or_ep_group`` of the wrong kind, an unknown knob, or a layout naming something that is
            not a 3-D per-expert tensor of its module (e.g. a list of per-expert modules).
        NotImplementedError: an experts module variant that cannot be sharded (or mapped onto TE).
        ImportError: ``dispatcher="flex"`` without DeepEP / CUDA.
    """
    ep_group = _ep_group_of(groups_or_ep_group)
    validate_capacity(capacity_factor, token_drop_policy, owner="`apply_expert_parallel`")
    ep = group_size(ep_group)
    found = find_experts(model)
    experts_capacity: dict[str, float | None] = {}
    layouts: dict[str, ExpertsLayout] = {}
    for name, item in found.items():
        check_expert_split(item.num_experts, ep, owner=f"`apply_expert_parallel` ({name})")
        experts_capacity[name] = _experts_capacity(item, capacity_factor, token_drop_policy)
        layouts[name] = item.adapter.layout(item.module)
        check_layout_math(name, item.module, item.adapter.name, layouts[name])  # its forward is not called after
    if dispatcher == "flex" and knobs.get("deepep_buffers") is None and knobs.get("deepep_buffer") is None:
        # One DeepEP buffer per process, shared by every layer (each buffer pins hundreds of MB of NVLink memory).
        knobs = {**knobs, "deepep_buffers": DeepEPBuffers(knobs.get("deepep_num_sms", 20))}
    wrapped: list[ExpertParallelExperts] = []
    for name, item in found.items():
        layout = layouts[name]
        token_dispatcher = build_dispatcher(dispatcher, ep_group, item.num_experts, runtime, **knobs)
        ep_module = ExpertParallelExperts(
            item.module,
            layout,
            token_dispatcher,
            capacity_factor=experts_capacity[name],
            token_drop_policy=token_drop_policy,
            impl=impl,
            expert_backend=expert_backend,
            ep_mesh=ep_mesh,
        )
        ep_module.train(item.module.training)  # the mode the replaced module had (from_pretrained: eval)
        setattr(item.parent, item.attr, ep_module)
        if isinstance(item.parent, MoELayer):
            item.parent.runtime = runtime
            if shared_expert_overlap and item.parent.shared_experts is not None:
                item.parent.shared_expert_overlap = True
        elif shared_expert_overlap and runtime is not None:
            overlap_shared_experts(item.parent, runtime)
        wrapped.append(ep_module)
    return wrapped


def _experts_capacity(item: FoundExperts, capacity_factor: float | None, token_drop_policy: str) -> float | None:
    """The factor the expert-parallel module drops with, so that a layer drops over capacity exactly once.

    A :class:`MoELayer` with a ``capacity_factor`` of its own drops before its experts: its experts get ``None``.
    The same setting given here too is that one drop; a different one is an error (two drops would keep the
    smaller capacity, which neither setting says).
    """
    layer = item.parent
    if not isinstance(layer, MoELayer) or layer.capacity_factor is None:
        return capacity_factor
    if capacity_factor is not None and (capacity_factor, token_drop_policy) != (
        layer.capacity_factor,
        layer.token_drop_policy,
    ):
        raise ValueError(
            f"`apply_expert_parallel` ({item.name}): capacity_factor={capacity_factor!r}, "
            f"token_drop_policy={token_drop_policy!r} given here, but its `MoELayer` drops with "
            f"capacity_factor={layer.capacity_factor!r}, token_drop_policy={layer.token_drop_policy!r}; a layer drops "
            "over capacity once, with one setting. Set the capacity in one place (the `MoELayer`, or here, e.g. "
            "`MoEOverlapStrategy(capacity_factor=...)`), or give both the same values."
        )
    return None


def layout_of(module: nn.Module) -> ExpertsLayout:
    """The layout an adapter reads from ``module``; ``TypeError`` when no adapter recognises it."""
    adapter = adapter_for(module)
    if adapter is None:
        raise TypeError(
            f"`layout_of`: no adapter recognises {type(module).__name__}; experts modules need 3-D per-expert "
            "parameters and forward(hidden_states, top_k_index, top_k_weights). Register one with "
            "`register_experts_adapter` (docs/adapters.md)."
        )
    return adapter.layout(module)


__all__ = [
    "ADAPTERS",
    "HF_V5_ADAPTER",
    "OWN_ADAPTER",
    "ExpertsAdapter",
    "FoundExperts",
    "adapter_for",
    "apply_expert_parallel",
    "expert_parallel_modules",
    "find_experts",
    "find_moe_blocks",
    "layout_of",
    "register_experts_adapter",
    "registered_adapters",
    "unregister_experts_adapter",
]
