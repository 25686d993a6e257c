"""The side-work queues are per execution context (``overlap/pending.py``): a context's side work is run only by
that context, at its own comm points (a metadata exchange's hold is its own too), by ``result()``, or at the end of
its task; never by the partner it hands the baton to."""

from __future__ import annotations

from lightning_moe_overlap.overlap import run_schedule
from lightning_moe_overlap.overlap.pending import PendingWork
from lightning_moe_overlap.overlap.runtime import CommRuntime
from lightning_moe_overlap.overlap.schedule import Role

F, B = Role.FORWARD, Role.BACKWARD


def test_each_context_runs_only_its_own_queue() -> None:
    pending, ran = PendingWork(), []
    pending.submit(lambda: ran.append("f"), F)
    pending.submit(lambda: ran.append("b"), B)
    pending.submit(lambda: ran.append("outside"), None)
    pending.run_side_work(B)
    assert ran == ["b"]
    pending.run_side_work(F)
    assert ran == ["b", "f"] and pending.queued_side_work(F) == 0 and pending.queued_side_work(None) == 1
    pending.run_side_work(None)
    assert ran == ["b", "f", "outside"]


def test_a_hold_holds_exactly_one_run_of_its_own_context() -> None:
    pending, ran = PendingWork(), []
    pending.submit(lambda: ran.append("f"), F)
    pending.submit(lambda: ran.append("b"), B)
    pending.hold_side_work(F)
    pending.run_side_work(B)  # the partner's comm point: its own queue, not held
    assert ran == ["b"]
    pending.run_side_work(F)  # the metadata comm point's own hand-over: held
    assert ran == ["b"]
    pending.run_side_work(F)  # the next one (the token dispatch)
    assert ran == ["b", "f"]


def test_outside_a_schedule_a_hold_holds_one_run() -> None:
    pending, ran = PendingWork(), []
    pending.submit(lambda: ran.append(1), None)
    pending.hold_side_work(None)
    pending.run_side_work(None)
    assert ran == []  # held at this (metadata) comm point
    pending.run_side_work(None)
    assert ran == [1]  # ran at the next one


def test_draining_runs_the_queue_whatever_the_hold_and_result_runs_once() -> None:
    pending, ran = PendingWork(), []
    work = pending.submit(lambda: ran.append("f") or 7, F)
    assert work.result() == 7 and ran == ["f"]  # the submitting block takes it
    pending.submit(lambda: ran.append("g"), F)
    pending.hold_side_work(F)
    pending.drain_side_work(F)
    assert ran == ["f", "g"] and pending.queued_side_work(F) == 0  # the taken work did not run again


def test_work_held_past_a_handover_runs_in_its_own_context_at_its_next_comm_point() -> None:
    """Overlapped ``F0, F1|B0, F2|B1, B2``: the backward holds the baton first in a pair and hands over at each of
    its comm points while the forward's side work is held. Oracle: the forward's own progress when the work ran
    (set by the forward between its comm points) and the running context the runtime reports."""
    runtime, num_microbatches = CommRuntime(), 3
    ran: dict[int, tuple[Role | None, str]] = {}
    where = ["start"] * num_microbatches

    def forward_fn(i: int) -> None:
        runtime.submit(lambda: ran.setdefault(i, (runtime.context, where[i])))
        where[i] = "counts"
        runtime.hold_side_work()
        runtime.handoff()
        where[i] = "tokens"
        runtime.handoff()
        where[i] = "combine"
        runtime.handoff()

    def backward_fn(i: int, _: object) -> None:
        for _ in range(4):  # more comm points than the forward, so the backward hands over while work is held
            runtime.handoff()

    run_schedule(forward_fn, backward_fn, num_microbatches, runtime, overlap=True, timeout_s=30)
    assert ran == {i: (F, "tokens") for i in range(num_microbatches)}


def test_work_a_task_left_queued_runs_at_its_end_not_in_the_next_task_of_its_role() -> None:
    runtime, ran, where = CommRuntime(), [], ["", ""]

    def forward_fn(i: int) -> None:
        if i == 0:
            runtime.submit(lambda: ran.append((runtime.context, *where)))
            runtime.hold_side_work()
            runtime.handoff()  # held, and no comm point after it in this task
            where[0] = "F0 ended"
        else:
            where[1] = "F1 started"
            runtime.handoff()

    run_schedule(forward_fn, lambda i, _: runtime.handoff(), 2, runtime, overlap=True, timeout_s=30)
    assert ran == [(F, "F0 ended", "")]  # after F0's body, before F1 began
