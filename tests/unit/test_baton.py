"""Baton semantics in one process, with fake comm points: order, partner-finished path, errors, safety nets."""

from __future__ import annotations

import threading
import traceback

import pytest
import torch

from lightning_moe_overlap.overlap import Baton, BatonAborted, CommRuntime, Role, run_schedule


def lane_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("moe-overlap-")]


class FakeModel:
    """Forward and backward made of named segments; a comm point (a hand-over) after each segment but the last."""

    def __init__(self, runtime: CommRuntime, forward_points: int = 2, backward_points: int = 2) -> None:
        self.runtime = runtime
        self.forward_points = forward_points
        self.backward_points = backward_points
        self.log: list[str] = []
        self.fail_at: str | None = None

    def _segments(self, name: str, points: int) -> None:
        for k in range(points + 1):
            self.log.append(f"{name}.{k}")
            if self.fail_at == f"{name}.{k}":
                raise ValueError(f"boom at {name}.{k}")
            if k < points:
                self.runtime.handoff()

    def forward(self, i: int) -> str:
        self._segments(f"F{i}", self.forward_points)
        return f"out{i}"

    def backward(self, i: int, output: str) -> None:
        assert output == f"out{i}"
        self._segments(f"B{i}", self.backward_points)


def test_pair_alternates_at_every_comm_point_backward_first() -> None:
    model = FakeModel(CommRuntime())
    outputs = run_schedule(model.forward, model.backward, 2, model.runtime, overlap=True)
    assert outputs == ["out0", "out1"]
    assert model.log == [
        "F0.0", "F0.1", "F0.2",                                      # F0 alone: hand-overs return at once
        "B0.0", "F1.0", "B0.1", "F1.1", "B0.2", "F1.2",              # F1|B0: backward starts, one segment each
        "B1.0", "B1.1", "B1.2",                                      # B1 alone
    ]


def test_sequential_schedule_never_interleaves() -> None:
    model = FakeModel(CommRuntime())
    run_schedule(model.forward, model.backward, 2, model.runtime, overlap=False)
    assert model.log == [f"{t}.{k}" for t in ("F0", "B0", "F1", "B1") for k in range(3)]


def test_partner_finished_context_continues_alone() -> None:
    model = FakeModel(CommRuntime(), forward_points=1, backward_points=4)
    run_schedule(model.forward, model.backward, 2, model.runtime, overlap=True)
    pair = model.log[model.log.index("B0.0") : model.log.index("B1.0")]
    assert pair == ["B0.0", "F1.0", "B0.1", "F1.1", "B0.2", "B0.3", "B0.4"]


def test_forward_with_more_comm_points_than_backward() -> None:
    model = FakeModel(CommRuntime(), forward_points=3, backward_points=0)
    run_schedule(model.forward, model.backward, 2, model.runtime, overlap=True)
    pair = model.log[model.log.index("B0.0") : model.log.index("B1.0")]
    assert pair == ["B0.0", "F1.0", "F1.1", "F1.2", "F1.3"]


def test_runtime_unbound_after_the_step() -> None:
    runtime = CommRuntime()
    model = FakeModel(runtime)
    run_schedule(model.forward, model.backward, 3, runtime, overlap=True)
    runtime.handoff()  # outside a schedule: no baton, returns at once
    assert not lane_threads()


@pytest.mark.parametrize(
    ("fail_at", "log_tail"),
    [("F1.1", ["B0.0", "F1.0", "B0.1", "F1.1"]), ("B0.1", ["B0.0", "F1.0", "B0.1"])],
    ids=["forward-context", "backward-context"],
)
def test_error_in_one_context_reraised_original_other_stopped(fail_at: str, log_tail: list[str]) -> None:
    model = FakeModel(CommRuntime())
    model.fail_at = fail_at
    with pytest.raises(ValueError, match=f"boom at {fail_at}") as info:
        run_schedule(model.forward, model.backward, 3, model.runtime, overlap=True)
    frames = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert frames[-1] == "_segments"  # the original traceback, down to the raising line
    # The partner stopped at its hand-over (no further segment) and no later phase started.
    assert model.log == ["F0.0", "F0.1", "F0.2", *log_tail]
    assert not lane_threads()
    assert model.runtime.handoff() is None  # the runtime is unbound again


def test_error_inside_autograd_backward_keeps_type_and_traceback() -> None:
    runtime = CommRuntime()

    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
            runtime.handoff()
            return x * 2

        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
            runtime.handoff()
            raise KeyError("backward exploded")

    w = torch.ones(3, requires_grad=True)
    with pytest.raises(KeyError, match="backward exploded") as info:
        run_schedule(
            lambda i: Fails.apply(w * i).sum(), lambda i, loss: loss.backward(), 2, runtime, overlap=True
        )
    assert "backward" in [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert not lane_threads()


def test_handoff_timeout_names_the_phase_and_does_not_hang() -> None:
    runtime = CommRuntime()
    release = threading.Event()

    def forward(i: int) -> int:
        runtime.handoff()
        return i

    def backward(i: int, output: int) -> None:
        release.wait(30)  # holds the baton without handing over: the forward context waits for it
        runtime.handoff()

    with pytest.raises(RuntimeError, match=r"Phase F1\|B0: the forward context waited 0.3 s for the baton"):
        run_schedule(forward, backward, 2, runtime, overlap=True, timeout_s=0.3)
    assert lane_threads()  # raised while the stuck context still holds the baton, not after it let go
    release.set()
    for thread in lane_threads():
        thread.join(5)  # the stuck context aborts at its next hand-over once released
    assert not lane_threads()


def test_phase_without_progress_raises_naming_the_phase() -> None:
    runtime = CommRuntime()
    release = threading.Event()
    with pytest.raises(RuntimeError, match="Phase F0 made no progress"):
        # Two micro-batches: with one, F0 runs in the calling thread, where the process group's timeout is the net.
        run_schedule(lambda i: release.wait(30), lambda i, out: None, 2, runtime, overlap=True, timeout_s=0.3)
    assert lane_threads()  # raised while F0 is still stuck, not after it returned
    release.set()
    for thread in lane_threads():
        thread.join(5)
    assert not lane_threads()


def test_abort_is_not_swallowed_by_except_exception() -> None:
    baton = Baton([Role.FORWARD, Role.BACKWARD], phase="F1|B0", starter=Role.BACKWARD, timeout_s=5)
    baton.abort()
    with pytest.raises(BatonAborted):
        try:
            baton.handoff()
        except Exception:  # noqa: BLE001 - model code like this must not hide the abort
            pytest.fail("BatonAborted was caught by `except Exception`")


def test_single_context_baton_never_blocks() -> None:
    baton = Baton([Role.FORWARD], phase="F0", starter=Role.FORWARD, timeout_s=0.01)
    ran: list[int] = []

    def task() -> None:
        for _ in range(3):
            baton.handoff()
        ran.append(1)

    baton.run(Role.FORWARD, task)
    assert ran == [1] and baton.wait_done(0) and not baton.errors
    assert baton.progress == 4  # three hand-overs and the finish


@pytest.mark.parametrize(
    ("roles", "starter"),
    [([], Role.FORWARD), ([Role.FORWARD, Role.FORWARD], Role.FORWARD), ([Role.FORWARD], Role.BACKWARD)],
)
def test_baton_rejects_bad_roles(roles: list[Role], starter: Role) -> None:
    with pytest.raises(ValueError, match="one or two distinct roles"):
        Baton(roles, phase="x", starter=starter, timeout_s=1)


def test_schedule_refuses_a_runtime_already_in_use() -> None:
    runtime = CommRuntime()
    other = Baton([Role.FORWARD], phase="other", starter=Role.FORWARD, timeout_s=1)
    with runtime.phase.bound(other), pytest.raises(RuntimeError, match="a schedule is already active"):
        run_schedule(lambda i: i, lambda i, out: None, 1, runtime, overlap=True)
    assert not lane_threads()
