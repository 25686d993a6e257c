"""Token dispatchers: move routed tokens to the ranks of their experts and back, in stages, with comm points."""

from lightning_moe_overlap.moe.dispatch.allgather import AllGatherDispatcher, AllGatherHandle
from lightning_moe_overlap.moe.dispatch.alltoall import AllToAllDispatcher, AllToAllHandle
from lightning_moe_overlap.moe.dispatch.base import DispatcherBase, TokenDispatcher, check_expert_split
from lightning_moe_overlap.moe.dispatch.deepep_buffers import DeepEPBuffers
from lightning_moe_overlap.moe.dispatch.factory import DISPATCHER_CLASSES, DISPATCHER_KNOBS, build_dispatcher
from lightning_moe_overlap.moe.dispatch.flex import FlexDispatcher, FlexHandle, require_flex_backend

__all__ = [
    "DISPATCHER_CLASSES",
    "DISPATCHER_KNOBS",
    "AllGatherDispatcher",
    "AllGatherHandle",
    "AllToAllDispatcher",
    "AllToAllHandle",
    "DeepEPBuffers",
    "DispatcherBase",
    "FlexDispatcher",
    "FlexHandle",
    "TokenDispatcher",
    "build_dispatcher",
    "check_expert_split",
    "require_flex_backend",
]
