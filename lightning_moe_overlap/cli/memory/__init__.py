"""What a run needs in memory, per rank, before it starts: the ``check`` command's memory table (docs/memory.md,
"Before launch: `check`'s memory table").

One concept per module, each a set of pure functions of a model built on the meta device and the run's settings:

- ``optimizer_state.py``: how many state tensors an optimizer keeps per parameter;
- ``held.py``: the bytes of parameters, gradients and optimizer state one process of each pp rank holds;
- ``activations.py``: what autograd saves for backward in one layer, per micro-batch, and what recompute and
  activation offload leave of it;
- ``in_flight.py``: how many micro-batches' activations each pp rank holds at the schedule's peak;
- ``estimate.py``: the settings read from a ``fit`` config and the per-rank :class:`RankMemory` rows;
- ``table.py``: the printed table and the device-memory warning.
"""

from lightning_moe_overlap.cli.memory.estimate import MemorySettings, RankMemory, estimate_memory, settings_from_config
from lightning_moe_overlap.cli.memory.table import device_memory_bytes, memory_table, memory_warnings

__all__ = [
    "MemorySettings",
    "RankMemory",
    "device_memory_bytes",
    "estimate_memory",
    "memory_table",
    "memory_warnings",
    "settings_from_config",
]
