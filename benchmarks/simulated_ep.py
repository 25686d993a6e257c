"""Simulated expert parallelism on one device, the extras of ``overlap.py --simulate-ep MS``.

World size 1, ``ep=1``, every all-to-all issued as a loopback of known duration (``moe/dispatch/loopback.py``). This
module adds what only the simulation measures: host syncs per overlapped step (CUDA's sync debug mode) and one
overlapped step as a ``torch.profiler`` Chrome trace, where the loopback's sleep kernels on the side stream run
under the other context's compute kernels.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch

from lightning_moe_overlap.moe.dispatch.loopback import Loopback


def make_deterministic() -> None:
    """Deterministic kernels, so overlapped and sequential runs can be compared bitwise (before CUDA starts)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def loopback(comm_ms: float, device: torch.device) -> Loopback:
    """The communicator of an ep=1 model's runtime that issues every all-to-all as a loopback of ``comm_ms``
    milliseconds (``CommRuntime(communicator=loopback(...))``)."""
    return Loopback(comm_ms / 1e3, device)


def count_host_syncs(step: Callable[[], None], device: torch.device) -> int | None:
    """Synchronising CUDA calls during ``step`` (``torch.cuda.set_sync_debug_mode("warn")``); None on CPU."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in caught)


def export_trace(step: Callable[[], None], path: str, device: torch.device) -> str:
    """Run ``step`` under ``torch.profiler`` and write its Chrome trace to ``path``."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    prof.export_chrome_trace(path)
    return path
