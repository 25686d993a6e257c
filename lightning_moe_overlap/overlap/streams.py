"""CUDA device and stream of the execution contexts; no-ops on CPU.

Choice: both contexts share the compute stream, the current stream of the thread that starts the schedule. The
all-to-all runs on NCCL's internal stream: at issue NCCL makes its stream wait for the compute stream, and
``work.wait()`` makes the compute stream wait for NCCL's, without blocking the CPU. So after a hand-over the
other context enqueues its kernels on the compute stream while the all-to-all is in flight on NCCL's stream, and
the kernels of the two contexts execute in the order the baton issued them.

Why not one stream per context: the contexts never run their CPU side at the same time, so a second compute
stream would only let the GPU run both contexts' kernels concurrently (they compete for the same SMs) at the cost
of cross-stream events and ``record_stream`` for every tensor one context frees and the caching allocator hands
to the other (the race Tutel hit, see its PR #84).

``CUDA_DEVICE_MAX_CONNECTIONS`` must be greater than 1 (CUDA's default is 8): with 1 hardware queue, NCCL's kernel
and the compute kernels serialise in launch order and nothing overlaps. Megatron recommends 32 for EP overlap.

CUDA is used lazily: nothing here initialises it; a process that never touched CUDA gets the CPU no-ops.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


def cuda_in_use() -> bool:
    """True once this process initialised CUDA (never initialises it itself)."""
    return torch.cuda.is_initialized()


@dataclass(frozen=True)
class StreamState:
    """The CUDA device and current stream a context runs with; empty on CPU."""

    device: int | None = None
    stream: Any = None  # torch.cuda.Stream

    @classmethod
    def capture(cls) -> StreamState:
        """The calling thread's current device and stream (thread-local in CUDA and PyTorch)."""
        if not cuda_in_use():
            return cls()
        device = torch.cuda.current_device()
        return cls(device, torch.cuda.current_stream(device))

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Make them current in this thread."""
        if self.device is None:
            yield
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            yield


def device_max_connections_warning() -> str | None:
    """A warning text when overlap cannot work because ``CUDA_DEVICE_MAX_CONNECTIONS=1``, else None."""
    value = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if value is None or not cuda_in_use():
        return None
    if value.strip() == "1":
        return (
            "CUDA_DEVICE_MAX_CONNECTIONS=1 serialises NCCL's all-to-all with the compute kernels in one hardware "
            "queue, so the overlap engine hides no communication. Set it to 32 (or unset it) before CUDA starts; "
            "tensor/context parallelism may prefer 1, so choose by which communication dominates."
        )
    return None
