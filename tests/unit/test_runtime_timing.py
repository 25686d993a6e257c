"""Opt-in communication timing of ``CommRuntime``: ``runtime.wait(work)`` with and without an attached ``CommTimer``.

The timer reads a virtual clock (tests/helpers/clock.py): compute advances it, a wait moves it to the collective's
completion, so each assertion is about which waits blocked and for what part of the collective, never about how
fast the machine ran.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_moe_overlap.moe.dispatch import comm
from lightning_moe_overlap.overlap import run_schedule
from lightning_moe_overlap.overlap import observers as observers_module
from lightning_moe_overlap.overlap.observers import CommObserver, CommTimer, CommTimes
from lightning_moe_overlap.overlap.runtime import CommRuntime
from lightning_moe_overlap.overlap.schedule import Role
from tests.helpers.clock import TimedWork, VirtualClock

EPS = 1e-12  # float sums of the clock's steps


@pytest.fixture
def clock(monkeypatch) -> VirtualClock:
    return VirtualClock().install(monkeypatch, observers_module)


def test_wait_without_timer_is_plain_wait(clock) -> None:
    runtime = CommRuntime()
    work = TimedWork(clock, 0.0)
    runtime.handoff()
    assert runtime.wait(work) is True
    assert work.waits == 1
    assert runtime.observers == ()


def test_timer_records_blocked_and_in_flight_time(clock) -> None:
    runtime = CommRuntime()
    runtime.attach(timer := CommTimer())
    work = TimedWork(clock, 0.05)
    runtime.handoff()
    clock.advance(0.02)  # compute while the collective is in flight: hides part of it
    assert runtime.wait(work) is True
    times = timer.snapshot()
    assert times.waits == 1
    assert times.blocked_s == pytest.approx(0.03, abs=EPS)  # the part the compute did not hide
    assert times.in_flight_s == pytest.approx(0.05, abs=EPS)  # hand-over to the end of the wait
    assert times.max_blocked_s == times.blocked_s
    assert timer.reset() == times
    assert timer.snapshot() == CommTimes()


def test_finished_collective_blocks_for_no_time(clock) -> None:
    runtime = CommRuntime()
    with runtime.attach(CommTimer()) as timer:
        work = TimedWork(clock, 0.0)
        runtime.handoff()
        clock.advance(0.01)
        runtime.wait(work)
    times = timer.snapshot()
    assert times.blocked_s == 0.0 and times.in_flight_s == pytest.approx(0.01, abs=EPS)


def test_wait_without_handoff_counts_the_wait_only(clock) -> None:
    timer = CommTimer()
    timer.wait(TimedWork(clock, 0.01))
    times = timer.snapshot()
    assert times.in_flight_s == times.blocked_s == pytest.approx(0.01, abs=EPS)


def test_attach_in_a_block_detaches_after_it_and_leaves_the_others(clock) -> None:
    runtime = CommRuntime()
    outer = runtime.attach(CommTimer())
    inner = CommTimer()
    with runtime.attach(inner) as attached:
        assert attached is inner and runtime.observers == (outer.observer, inner)
        runtime.wait(TimedWork(clock, 0.0))
    assert runtime.observers == (outer.observer,)
    runtime.wait(TimedWork(clock, 0.0))
    assert inner.snapshot().waits == 1 and outer.observer.snapshot().waits == 2
    outer.remove()
    assert runtime.observers == ()


def test_attaching_the_same_observer_twice_is_refused() -> None:
    runtime = CommRuntime()
    timer = CommTimer()
    runtime.attach(timer)
    with pytest.raises(ValueError, match=r"CommTimer is already attached.*Remove the first handle"):
        runtime.attach(timer)


def test_observers_see_every_comm_point_event_in_order() -> None:
    """Oracle: the order the module docstring of ``observers.py`` promises, for a comm point inside a schedule
    (with the hand-over) and outside one (without it, and with no holder)."""
    events: list[tuple[str, object]] = []

    class Log(CommObserver):
        def on_task_start(self, task) -> None:  # noqa: ANN001
            events.append(("task_start", task.name))

        def on_task_end(self, task) -> None:  # noqa: ANN001
            events.append(("task_end", task.name))

        def on_issue(self, holder) -> None:  # noqa: ANN001
            events.append(("issue", holder))

        def on_handoff(self, holder) -> None:  # noqa: ANN001
            events.append(("handoff", holder))

        def on_resume(self, holder) -> None:  # noqa: ANN001
            events.append(("resume", holder))

        def on_wait_start(self, holder) -> None:  # noqa: ANN001
            events.append(("wait_start", holder))

        def on_wait_end(self, holder) -> None:  # noqa: ANN001
            events.append(("wait_end", holder))

    runtime = CommRuntime()

    def point() -> None:
        runtime.handoff()
        runtime.wait(TimedWork(VirtualClock(), 0.0))

    with runtime.attach(Log()):
        point()
        run_schedule(lambda i: point(), lambda i, out: None, 1, runtime, overlap=True)
    point()  # detached: nothing more
    f = Role.FORWARD
    assert events == [
        ("issue", None), ("wait_start", None), ("wait_end", None),
        ("task_start", "F0"), ("issue", f), ("handoff", f), ("resume", f), ("wait_start", f), ("wait_end", f),
        ("task_end", "F0"), ("task_start", "B0"), ("task_end", "B0"),
    ]


def test_synchronize_hook_runs_at_handoff_and_after_wait(clock) -> None:
    calls: list[str] = []
    runtime = CommRuntime()
    runtime.attach(CommTimer(synchronize=lambda: calls.append("sync")))
    work = TimedWork(clock, 0.0)
    runtime.handoff()
    runtime.wait(work)
    assert calls == ["sync", "sync"]


def test_comm_helper_waits_with_and_without_runtime(clock) -> None:
    comm.wait(None, work := TimedWork(clock, 0.0))
    assert work.waits == 1
    runtime = CommRuntime()
    with runtime.attach(CommTimer()) as timer:
        comm.wait(runtime, TimedWork(clock, 0.0))
    assert timer.snapshot().waits == 1


def test_real_gloo_work_is_timed() -> None:
    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    runtime = CommRuntime()
    with runtime.attach(CommTimer()) as timer:
        t = torch.ones(4)
        work = pg.allreduce([t])
        runtime.handoff()
        runtime.wait(work)
    assert torch.equal(t, torch.ones(4))
    assert timer.snapshot().waits == 1


def _step(clock: VirtualClock, overlap: bool, duration_s: float, compute_s: float) -> tuple[CommTimes, list[float]]:
    """Two micro-batches, each forward and backward: compute, issue + hand over, wait, compute. Returns the totals
    and each wait's blocked time in the order the waits ended."""
    runtime = CommRuntime()
    blocked: list[float] = []

    class Recording(CommTimer):
        def record(self, blocked_s: float, in_flight_s: float) -> None:
            blocked.append(blocked_s)
            super().record(blocked_s, in_flight_s)

    def segment() -> None:
        clock.advance(compute_s)
        work = TimedWork(clock, duration_s)
        runtime.handoff()
        runtime.wait(work)
        clock.advance(compute_s)

    with runtime.attach(Recording()) as timer:
        run_schedule(lambda i: segment(), lambda i, out: segment(), 2, runtime, overlap=overlap)
    return timer.snapshot(), blocked


def test_overlap_hides_communication_that_sequential_exposes(clock) -> None:
    """Sequential: every wait blocks ``d``. Overlapped: ``F0`` and ``B1`` run alone and block ``d`` each; in the pair
    ``F1|B0`` each collective is in flight while the other context computes (``c > d``), so neither wait blocks."""
    d, c = 0.03, 0.06
    sequential, seq_blocked = _step(clock, False, duration_s=d, compute_s=c)
    overlapped, ovl_blocked = _step(clock, True, duration_s=d, compute_s=c)
    assert sequential.waits == overlapped.waits == 4
    assert seq_blocked == pytest.approx([d, d, d, d], abs=EPS)
    assert ovl_blocked == pytest.approx([d, 0.0, 0.0, d], abs=EPS)  # F0, then the pair's two waits, then B1
    assert sequential.blocked_s == pytest.approx(4 * d, abs=EPS)
    assert overlapped.blocked_s == pytest.approx(2 * d, abs=EPS)
