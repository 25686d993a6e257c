"""The one kind of host sync the dispatchers keep: sizes read back to the host after a collective's wait.

An uneven ``all_to_all_single`` takes its split sizes as Python ints, and slicing the rows routed to the local
experts needs their number on the host, so a dispatcher must read a few integers back from the device once per
dispatch. :func:`host_ints` is the only place it does so, and its callers call it only after waiting on the
collective that produced the sizes, so after the hand-over, where the context resumes: never between issuing a
collective and handing over, and only once the partner context has queued its compute. Given the runtime, each read is
reported to its observers (``on_host_read``; ``overlap/order.py`` records the order). On CUDA the copy goes
non-blocking into pinned host memory and the CPU waits on an event recorded right after it, as Megatron's
dispatchers do: the CPU waits for the work queued so far on the current stream, and the copy itself does not
go through a pageable staging buffer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from lightning_moe_overlap.overlap.runtime import CommRuntime


def host_ints(values: Tensor, runtime: CommRuntime | None = None) -> list:
    """``values.tolist()`` (nested like ``values``), read from pinned host memory on CUDA; reported to ``runtime``'s
    observers when given."""
    if runtime is not None:
        runtime.report_host_read()
    if values.device.type != "cuda":
        return values.tolist()  # NOTE: D2H sync (on CUDA only; a no-op read on CPU)
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(values.device))
    copied.synchronize()  # NOTE: D2H sync (the split sizes; the CPU waits for the copy)
    return host.tolist()
