"""Optimizer wrappers: the state and update of a share of the parameters in host memory (``host_offload.py``)."""

from lightning_moe_overlap.optim.host_copy import HostCopy
from lightning_moe_overlap.optim.host_offload import (
    OffloadedOptimizer,
    StateBytes,
    choose_offloaded,
    offload,
    offload_optimizers,
    state_bytes,
)

__all__ = [
    "HostCopy",
    "OffloadedOptimizer",
    "StateBytes",
    "choose_offloaded",
    "offload",
    "offload_optimizers",
    "state_bytes",
]
