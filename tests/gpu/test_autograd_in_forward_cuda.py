"""On CUDA: a forward task that calls ``torch.autograd.grad`` while the paired backward task waits at a comm point on
autograd's real device thread is stopped with an error naming the cause, well before the engine's timeout.

The CPU twin (``tests/unit/test_engine_autograd_in_forward.py``) emulates the device thread; this one runs CUDA's.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lightning_moe_overlap.overlap.engine import OverlapEngine
from lightning_moe_overlap.overlap.runtime import CommRuntime

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="Requires: CUDA (autograd's device thread)"),
]

TIMEOUT_S = 15


class _CommPoint(torch.autograd.Function):
    """Identity whose backward is a comm point; records the thread that ran it."""

    runtime: CommRuntime
    threads: list[str]

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        _CommPoint.threads.append(threading.current_thread().name)
        _CommPoint.runtime.handoff()
        return grad


def _run(autograd_in_forward: bool, overlap: bool = True) -> list:
    runtime = CommRuntime()
    _CommPoint.runtime, _CommPoint.threads = runtime, []
    engine = OverlapEngine(runtime, overlap=overlap, timeout_s=TIMEOUT_S, failure_poll_s=0.05)
    w = torch.ones(64, device="cuda", requires_grad=True)

    def forward(i: int):
        x = w * (i + 1)
        if autograd_in_forward:  # a gradient penalty, on CUDA tensors: its backward needs the device thread
            (g,) = torch.autograd.grad(x.sin().square().sum(), w, create_graph=True)
            x = x + g.square().sum()
        return _CommPoint.apply(x).sum()

    return engine.run(forward, lambda i, loss: loss.backward(), 2)


def test_autograd_in_a_paired_forward_raises_before_the_timeout():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"the forward context called torch.autograd.grad/backward.*device thread"):
        _run(autograd_in_forward=True)
    assert time.monotonic() - start < TIMEOUT_S, "detected only by the engine's timeout"


def test_the_comm_point_ran_on_autograds_device_thread_and_overlap_off_runs():
    """The premise (backward comm points run off the calling thread on CUDA), and the documented way out."""
    assert len(_run(autograd_in_forward=False)) == 2
    assert _CommPoint.threads and not any(name.startswith("moe-overlap-") for name in _CommPoint.threads)
    assert len(_run(autograd_in_forward=True, overlap=False)) == 2
