"""Opt-in communication timing of ``CommRuntime``: ``runtime.wait(work)`` with and without a ``CommTimer``."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from lightning_moe_overlap.moe.dispatch import comm
from lightning_moe_overlap.overlap import run_schedule
from lightning_moe_overlap.overlap.runtime import CommRuntime, CommTimer, CommTimes


class TimedWork:
    """A fake collective that completes ``duration_s`` after it was issued (its construction)."""

    def __init__(self, duration_s: float) -> None:
        self.done_at = time.perf_counter() + duration_s
        self.waits = 0

    def wait(self) -> bool:
        self.waits += 1
        time.sleep(max(0.0, self.done_at - time.perf_counter()))
        return True


def test_wait_without_timer_is_plain_wait() -> None:
    runtime = CommRuntime()
    work = TimedWork(0.0)
    runtime.handoff()
    assert runtime.wait(work) is True
    assert work.waits == 1
    assert runtime.timing is None


def test_timer_records_blocked_and_in_flight_time() -> None:
    runtime = CommRuntime()
    runtime.timing = timer = CommTimer()
    work = TimedWork(0.05)
    runtime.handoff()
    time.sleep(0.02)  # compute while the collective is in flight: hides part of it
    assert runtime.wait(work) is True
    times = timer.snapshot()
    assert times.waits == 1
    assert 0.02 <= times.blocked_s < 0.045
    assert times.in_flight_s >= 0.045
    assert times.max_blocked_s == times.blocked_s
    assert timer.reset() == times
    assert timer.snapshot() == CommTimes()


def test_finished_collective_blocks_for_no_time() -> None:
    runtime = CommRuntime()
    with runtime.timed() as timer:
        work = TimedWork(0.0)
        runtime.handoff()
        time.sleep(0.01)
        runtime.wait(work)
    times = timer.snapshot()
    assert times.blocked_s < 0.005 <= times.in_flight_s


def test_wait_without_handoff_counts_the_wait_only() -> None:
    timer = CommTimer()
    timer.wait(TimedWork(0.01))
    times = timer.snapshot()
    assert times.in_flight_s == times.blocked_s > 0


def test_timed_restores_the_previous_timer() -> None:
    runtime = CommRuntime()
    outer = CommTimer()
    runtime.timing = outer
    inner = CommTimer()
    with runtime.timed(inner) as attached:
        assert attached is inner and runtime.timing is inner
        runtime.wait(TimedWork(0.0))
    assert runtime.timing is outer
    assert inner.snapshot().waits == 1 and outer.snapshot().waits == 0


def test_synchronize_hook_runs_at_handoff_and_after_wait() -> None:
    calls: list[str] = []
    runtime = CommRuntime()
    runtime.timing = CommTimer(synchronize=lambda: calls.append("sync"))
    work = TimedWork(0.0)
    runtime.handoff()
    runtime.wait(work)
    assert calls == ["sync", "sync"]


def test_comm_helper_waits_with_and_without_runtime() -> None:
    comm.wait(None, work := TimedWork(0.0))
    assert work.waits == 1
    runtime = CommRuntime()
    with runtime.timed() as timer:
        comm.wait(runtime, TimedWork(0.0))
    assert timer.snapshot().waits == 1


def test_real_gloo_work_is_timed() -> None:
    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    runtime = CommRuntime()
    with runtime.timed() as timer:
        t = torch.ones(4)
        work = pg.allreduce([t])
        runtime.handoff()
        runtime.wait(work)
    assert torch.equal(t, torch.ones(4))
    assert timer.snapshot().waits == 1


def _step(runtime: CommRuntime, overlap: bool, duration_s: float, compute_s: float) -> CommTimes:
    """Two micro-batches, each forward and backward: compute, issue + hand over, wait, compute."""

    def segment() -> None:
        time.sleep(compute_s)
        work = TimedWork(duration_s)
        runtime.handoff()
        runtime.wait(work)
        time.sleep(compute_s)

    with runtime.timed() as timer:
        run_schedule(lambda i: segment(), lambda i, out: segment(), 2, runtime, overlap=overlap)
    return timer.snapshot()


def test_overlap_hides_communication_that_sequential_exposes() -> None:
    """Sequential: every wait blocks ``d``. Overlapped: the pair ``F1|B0`` hides both its collectives."""
    runtime = CommRuntime()
    sequential = _step(runtime, False, duration_s=0.03, compute_s=0.06)
    overlapped = _step(runtime, True, duration_s=0.03, compute_s=0.06)
    assert sequential.waits == overlapped.waits == 4
    assert sequential.blocked_s == pytest.approx(4 * 0.03, abs=0.03)
    assert overlapped.blocked_s < 0.75 * sequential.blocked_s
