"""``CommOrder`` (the order of issue, host read, hand-over and resume), the host reads reported to the runtime's
observers, and the shared experts at the token dispatch. The two-rank, overlapped version is
``tests/distributed/test_handover_order.py``; the per-context side-work queues are ``test_pending_side_work.py``."""

from __future__ import annotations

import torch

from lightning_moe_overlap.moe import MoELayer, apply_expert_parallel
from lightning_moe_overlap.moe.dispatch.host import host_ints
from lightning_moe_overlap.overlap.order import OUTSIDE, CommOrder
from lightning_moe_overlap.overlap.runtime import CommRuntime
from lightning_moe_overlap.overlap.schedule import Role, Task


def test_a_host_read_between_issue_and_handoff_is_found_and_one_after_the_resume_is_not() -> None:
    order = CommOrder()
    forward, backward = Task(Role.FORWARD, 1), Task(Role.BACKWARD, 0)
    order.on_task_start(backward)
    order.on_issue(Role.BACKWARD)
    order.on_handoff(Role.BACKWARD)
    order.on_task_start(forward)
    order.on_issue(Role.FORWARD)
    order.on_host_read(Role.FORWARD)  # the bad place: before its hand-over
    order.on_handoff(Role.FORWARD)
    order.on_resume(Role.BACKWARD)
    order.mark("stage")
    order.on_host_read(Role.BACKWARD)  # fine: after the resume
    assert order.events == {
        "B0": ["issue", "handoff", "resume", "stage", "host_read"],
        "F1": ["issue", "host_read", "handoff"],
    }
    assert order.host_reads_before_handoff() == [("F1", 1)]


def test_outside_a_schedule_events_are_kept_but_not_checked() -> None:
    order = CommOrder()
    order.on_issue(None)
    order.on_host_read(None)
    assert order.events == {OUTSIDE: ["issue", "host_read"]}
    assert order.host_reads_before_handoff() == []


def test_host_ints_reports_to_the_runtime_observers() -> None:
    runtime, order = CommRuntime(), CommOrder()
    with runtime.attach(order):
        assert host_ints(torch.tensor([[3, 0], [1, 2]]), runtime) == [[3, 0], [1, 2]]
        assert host_ints(torch.tensor([4])) == [4]  # no runtime: nothing reported
    assert order.events == {OUTSIDE: ["host_read"]}


def test_shared_experts_run_at_the_token_dispatch_not_at_the_count_exchange() -> None:
    torch.manual_seed(0)
    layer = MoELayer(16, 8, 4, 2, shared_expert_ffn_hidden_size=12, shared_expert_overlap=True)
    runtime, order = CommRuntime(), CommOrder()
    apply_expert_parallel(layer, None, dispatcher="alltoall", runtime=runtime)
    layer.shared_experts.register_forward_hook(lambda *_: order.mark("shared"))
    with runtime.attach(order):
        layer(torch.randn(2, 5, 16))
    # counts, then their read; tokens with the shared experts in their window; combine.
    assert order.events == {OUTSIDE: ["issue", "host_read", "issue", "shared", "issue"]}
