"""Find the experts modules of any model: the adapters that recognise them and the search (making them
expert-parallel is ``moe/ep.py``'s :func:`~lightning_moe_overlap.moe.ep.apply_expert_parallel`).

An *adapter* recognises one kind of experts module and describes its storage (:class:`ExpertsLayout`). Built in:

- ``lightning_moe_overlap``: this package's :class:`~lightning_moe_overlap.moe.experts.Experts`;
- ``transformers_v5``: Hugging Face transformers v5 experts modules, matched by structure: 3-D ``gate_up_proj``
  (or ``up_proj``) and ``down_proj`` parameters with the same number of experts, an ``act_fn`` (or its own
  ``_apply_gate``), and a
  ``forward(hidden_states, top_k_index, top_k_weights)``. The flags HF sets with ``use_experts_implementation``
  (``is_transposed``, ``has_bias``, ``has_gate``) and a custom ``_apply_gate`` are honoured, which covers
  Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V2/V3, GPT-OSS, Nemotron-H and the other v5 MoE models.

Other blocks: :func:`register_experts_adapter` (user adapters are tried before the built-in ones).

An experts module already made expert-parallel says so with a class attribute (:data:`EXPERT_PARALLEL_ATTR`), so
that this module needs nothing of the expert-parallel machinery to skip it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_moe_overlap.moe.experts import Experts
from lightning_moe_overlap.moe.experts_layout import ExpertsLayout, method_without_weights
from lightning_moe_overlap.moe.layout_check import check_layout_tensors
from lightning_moe_overlap.registry import Registry

EXPERT_PARALLEL_ATTR = "moe_overlap_expert_parallel"  # True on the class of an expert-parallel experts module


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
    if isinstance(module, Experts) or is_expert_parallel(module):
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
        if is_expert_parallel(child):
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
    return [name for name, module in model.named_modules() if is_expert_parallel(module)]


def is_expert_parallel(module: nn.Module) -> bool:
    """Whether ``module`` is an expert-parallel experts module (its class sets :data:`EXPERT_PARALLEL_ATTR`)."""
    return getattr(type(module), EXPERT_PARALLEL_ATTR, False) is True


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
    "expert_parallel_modules",
    "is_expert_parallel",
    "find_experts",
    "find_moe_blocks",
    "layout_of",
    "register_experts_adapter",
    "registered_adapters",
    "unregister_experts_adapter",
]
