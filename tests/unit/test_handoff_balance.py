"""Balanced hand-overs: per MoE layer, the backward hands over as often as the forward, and the extra backward
hand-over sits between the down projection's and the gate/up projection's gradients (docs/overlap.md)."""

from __future__ import annotations

import pytest
import torch

from lightning_moe_overlap.moe import MoELayer, apply_expert_parallel
from lightning_moe_overlap.overlap.backward_handoff import backward_handoff
from lightning_moe_overlap.overlap.runtime import CommRuntime
from tests.unit.test_dispatch_flex import FakeDeepEPBuffer


class LoggingRuntime(CommRuntime):
    """Logs each hand-over with the grad mode and the weight gradients queued when it was reached."""

    def __init__(self, delay_wgrad: bool = False) -> None:
        super().__init__(delay_wgrad=delay_wgrad)
        self.log: list[tuple[bool, int]] = []

    def handoff(self) -> None:
        self.log.append((torch.is_grad_enabled(), self.pending_wgrad))
        super().handoff()


def _layer(dispatcher: str, runtime: CommRuntime) -> MoELayer:
    torch.manual_seed(0)
    layer = MoELayer(8, 4, 4, 2).double()
    knobs = {"deepep_buffer": FakeDeepEPBuffer()} if dispatcher == "flex" else {}
    apply_expert_parallel(layer, None, dispatcher=dispatcher, runtime=runtime, **knobs)
    return layer


@pytest.mark.parametrize(("dispatcher", "per_pass"), [("alltoall", 3), ("allgather", 5), ("flex", 2)])
def test_backward_hands_over_as_often_as_the_forward(dispatcher: str, per_pass: int) -> None:
    runtime = LoggingRuntime()
    layer = _layer(dispatcher, runtime)
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    forward = len(runtime.log)
    out.sum().backward()
    assert (forward, len(runtime.log) - forward) == (per_pass, per_pass)


def test_extra_backward_handoff_sits_between_the_two_projections() -> None:
    runtime = LoggingRuntime(delay_wgrad=True)
    layer = _layer("alltoall", runtime)
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    layer(x).sum().backward()
    backward = runtime.log[3:]
    # Combine backward: nothing queued yet. The extra hand-over: the down projection's weight gradient queued (its
    # gradient is done), the gate/up one not yet. Dispatch backward: the gate/up projection's queued.
    assert [pending for _, pending in backward] == [0, 1, 1]
    assert runtime.pending_wgrad == 0  # the dispatch backward's hand-over flushed the last one


def test_backward_handoff_is_an_identity_that_hands_over_in_backward_only() -> None:
    runtime = LoggingRuntime()
    x = torch.randn(4, 3, requires_grad=True)
    y = backward_handoff(x, runtime, count=2)
    assert torch.equal(y, x) and runtime.log == []
    (y * 3).sum().backward()
    assert len(runtime.log) == 2
    assert torch.equal(x.grad, torch.full_like(x, 3.0))


@pytest.mark.parametrize(
    ("runtime", "count", "requires_grad"), [(None, 1, True), (CommRuntime(), 0, True), (CommRuntime(), 1, False)]
)
def test_backward_handoff_is_a_no_op_when_nothing_would_hand_over(
    runtime: CommRuntime | None, count: int, requires_grad: bool
) -> None:
    x = torch.randn(2, requires_grad=requires_grad)
    assert backward_handoff(x, runtime, count) is x
