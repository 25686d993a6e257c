"""The overlap engine: two execution contexts and a baton, the micro-batch schedule, delayed weight gradients.

Entry point: :class:`OverlapEngine` (one per training run) or :func:`run_schedule` (one step). See
``docs/overlap.md`` for the design.
"""

from lightning_moe_overlap.overlap.baton import Baton, BatonAborted
from lightning_moe_overlap.overlap.engine import EngineStep, OverlapEngine, run_schedule
from lightning_moe_overlap.overlap.failures import PeerFailure
from lightning_moe_overlap.overlap.runtime import CommRuntime
from lightning_moe_overlap.overlap.schedule import Phase, Role, Task, build_schedule, pair

__all__ = [
    "Baton",
    "BatonAborted",
    "CommRuntime",
    "EngineStep",
    "OverlapEngine",
    "PeerFailure",
    "Phase",
    "Role",
    "Task",
    "build_schedule",
    "pair",
    "run_schedule",
]
