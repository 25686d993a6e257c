"""A forward task that calls autograd while the paired backward waits at a comm point on autograd's device thread
is stopped with an error naming the cause, not left to hang until the process-group timeout.

CUDA runs a device's backward functions on one autograd thread. The emulation: the backward task runs
``loss.backward()`` on a one-worker "device thread", so its comm point hands over from there; the forward task then
calls ``torch.autograd.grad`` through a function whose backward needs that same worker (as a CUDA graph needs the
device thread): without the engine's detection, each waits for the other.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

import pytest
import torch

from lightning_moe_overlap.overlap.engine import OverlapEngine
from lightning_moe_overlap.overlap.runtime import CommRuntime


class _DeviceThread:
    """One daemon worker that runs submitted calls in order, as autograd's device thread runs backward functions
    (it runs a call made from itself at once)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="device", daemon=True)
        self._thread.start()

    def run(self, fn):
        if threading.current_thread() is self._thread:
            return fn()
        done: Future = Future()
        self._jobs.put((fn, done))
        return done.result()

    def stop(self) -> None:
        self._jobs.put(None)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, done = job
            try:
                done.set_result(fn())
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                done.set_exception(err)


class _CommPoint(torch.autograd.Function):
    """Identity whose backward is a comm point (hands the baton over)."""

    runtime: CommRuntime

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        _CommPoint.runtime.handoff()
        return grad


class _OnDevice(torch.autograd.Function):
    """Identity whose backward runs on the device thread (as every CUDA backward function does)."""

    device: _DeviceThread

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _OnDevice.device.run(lambda: grad)


def _run(autograd_in_forward: bool, overlap: bool = True) -> tuple[list, list[str]]:
    runtime = CommRuntime()
    device = _DeviceThread()
    _CommPoint.runtime, _OnDevice.device = runtime, device
    engine = OverlapEngine(runtime, overlap=overlap, timeout_s=20, failure_poll_s=0.02)
    w = torch.ones(3, requires_grad=True)
    ran: list[str] = []

    def forward(i: int):
        x = w * (i + 1)
        if autograd_in_forward:  # a gradient penalty
            (g,) = torch.autograd.grad(_OnDevice.apply(x).square().sum(), w, create_graph=True)
            x = x + g.square().sum()
        ran.append(f"F{i}")
        return _CommPoint.apply(x).sum()

    def backward(i: int, loss) -> None:
        device.run(loss.backward)  # the backward functions run on the device thread
        ran.append(f"B{i}")

    try:
        return engine.run(forward, backward, 2), ran
    finally:
        device.stop()


def test_autograd_in_a_paired_forward_raises_instead_of_hanging():
    with pytest.raises(
        RuntimeError,
        match=r"Phase F1\|B0: the forward context called torch.autograd.grad/backward.*while the backward context "
        r"waits at a comm point inside autograd's device thread.*Set `overlap=False`",
    ):
        _run(autograd_in_forward=True)


def test_autograd_in_forward_runs_without_the_overlap():
    """The same step without overlap: every task alone, so the device thread is free when the forward needs it."""
    outputs, ran = _run(autograd_in_forward=True, overlap=False)
    assert ran == ["F0", "B0", "F1", "B1"] and len(outputs) == 2


def test_paired_steps_without_autograd_in_forward_are_not_flagged():
    outputs, ran = _run(autograd_in_forward=False)
    assert sorted(ran) == ["B0", "B1", "F0", "F1"] and len(outputs) == 2
