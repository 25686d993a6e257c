"""``build_dispatcher``: a dispatcher from its name, the ep group and the knobs of that backend."""

from __future__ import annotations

from typing import Any

from torch.distributed import ProcessGroup

from lightning_moe_overlap.moe.dispatch.allgather import AllGatherDispatcher
from lightning_moe_overlap.moe.dispatch.alltoall import AllToAllDispatcher
from lightning_moe_overlap.moe.dispatch.base import DispatcherBase, check_expert_split
from lightning_moe_overlap.moe.dispatch.comm import group_size
from lightning_moe_overlap.moe.dispatch.flex import FlexDispatcher
from lightning_moe_overlap.overlap.runtime import CommRuntime

# In the order of `config.DISPATCHERS` (the one spelling of the names; a unit test holds the two together).
DISPATCHER_CLASSES: dict[str, type[DispatcherBase]] = {
    cls.name: cls for cls in (AllToAllDispatcher, AllGatherDispatcher, FlexDispatcher)
}
# The knobs each backend reads; a knob of another backend is ignored, so one set of settings can serve any choice.
DISPATCHER_KNOBS: dict[str, tuple[str, ...]] = {name: cls.knobs for name, cls in DISPATCHER_CLASSES.items()}


def build_dispatcher(
    name: str, ep_group: ProcessGroup | None, num_experts: int, runtime: CommRuntime | None, **knobs: Any
) -> DispatcherBase:
    """Build the dispatcher called ``name`` (``"alltoall"``, ``"allgather"`` or ``"flex"``).

    Args:
        name: the dispatcher.
        ep_group: expert-parallel process group; ``None`` for a single process.
        num_experts: global number of experts (divisible by the group size).
        runtime: comm-point hand-over target shared by all layers of the model.
        **knobs: backend settings (alltoall: ``dedup``; flex: ``deepep_num_sms``, ``deepep_buffers``,
            ``deepep_buffer``). Knobs of other backends are accepted and ignored; unknown names raise ``TypeError``.

    Raises:
        ValueError: unknown ``name``, or ``num_experts`` not divisible by the ep size.
        TypeError: a knob no backend knows.
        ImportError: ``"flex"`` without DeepEP or CUDA (and no ``deepep_buffer`` or buffer factory).
    """
    if name not in DISPATCHER_CLASSES:
        raise ValueError(
            f"`build_dispatcher`: dispatcher={name!r} is not one of {list(DISPATCHER_CLASSES)}. Use 'alltoall' "
            "(default, any backend), 'allgather' (small ep, few tokens) or 'flex' (DeepEP, CUDA)."
        )
    check_expert_split(num_experts, group_size(ep_group), owner="`build_dispatcher`")
    known = {knob for names in DISPATCHER_KNOBS.values() for knob in names}
    unknown = sorted(set(knobs) - known)
    if unknown:
        raise TypeError(
            f"`build_dispatcher`: unknown knob(s) {unknown} for dispatcher={name!r}; the known knobs are "
            f"{DISPATCHER_KNOBS}. Check the spelling, or drop them."
        )
    mine = {key: value for key, value in knobs.items() if key in DISPATCHER_KNOBS[name]}
    return DISPATCHER_CLASSES[name](ep_group, num_experts, runtime, **mine)
