"""The engine's unit generalised: a pair of any forward task with any backward task (chunk and micro-batch free),
run one at a time through :meth:`OverlapEngine.step`, as a pipeline schedule's ``OVERLAP_F_B`` handler does."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from lightning_moe_overlap.overlap import CommRuntime, OverlapEngine, Role, Task
from lightning_moe_overlap.overlap.schedule import backward, build_schedule, forward, pair


class CommPoint(torch.autograd.Function):
    """A fake comm point: identity with a hand-over in forward and in backward, recording who handed over."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, runtime: CommRuntime, log: list[str], tag: str) -> torch.Tensor:  # noqa: ANN001
        ctx.args = (runtime, log, tag)
        log.append(f"{tag}:fwd")
        runtime.handoff()
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        runtime, log, tag = ctx.args
        log.append(f"{tag}:bwd")
        runtime.handoff()
        return grad.clone(), None, None, None


def test_task_names_keep_the_pp1_form_on_chunk_0_and_name_the_chunk_otherwise() -> None:
    assert Task(Role.FORWARD, 3).name == "F3" and Task(Role.BACKWARD, 3).chunk == 0
    assert forward(7, chunk=2).name == "2F7" and backward(3, chunk=1).name == "1B3"
    assert pair(forward(7, 0), backward(3, 2)).name == "F7|2B3"


def test_the_pp1_schedule_is_the_chunk_0_instance_of_pairs() -> None:
    phases = build_schedule(3, overlap=True)
    assert phases[1] == pair(forward(1), backward(0)) and all(t.chunk == 0 for p in phases for t in p.tasks)


def test_pair_rejects_tasks_in_the_wrong_roles() -> None:
    with pytest.raises(ValueError, match=r"one forward task and one backward task, got \(B1, F2\).*forward first"):
        pair(backward(1), forward(2))


def _chunks() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Sequential(nn.Linear(4, 4), nn.Tanh())


def _pipeline_like_step(overlap: bool) -> tuple[list[str], list[torch.Tensor], list[str]]:
    """Two chunks on one rank: forward of micro-batch 1 on chunk 0 paired with backward of micro-batch 0 on chunk 1
    (a V schedule's pair), each chunk with two comm points."""
    runtime, log, threads = CommRuntime(), [], []
    chunk0, chunk1 = _chunks()
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1))
    engine = OverlapEngine(runtime, overlap=overlap, timeout_s=30)

    def run(module: nn.Module, h: torch.Tensor, tag: str) -> torch.Tensor:
        threads.append(threading.current_thread().name)
        h = CommPoint.apply(module[0](h), runtime, log, f"{tag}a")
        return CommPoint.apply(module[1](h), runtime, log, f"{tag}b")

    outputs: dict[str, torch.Tensor] = {}
    with engine.step() as step:
        step.run_task(forward(0, 1), lambda: outputs.setdefault("c1", run(chunk1, x[0], "1F0")))

        def backward_fn() -> None:
            threads.append(threading.current_thread().name)
            outputs["c1"].square().sum().backward()

        step.run_pair(forward(1, 0), lambda: outputs.setdefault("c0", run(chunk0, x[1], "F1")), backward(0, 1), backward_fn)
        step.run_task(backward(1, 0), lambda: outputs["c0"].sum().backward())
    grads = [p.grad.clone() for m in (chunk0, chunk1) for p in m.parameters()]
    return log, grads, threads


def test_a_pair_of_different_chunks_hands_over_at_every_comm_point_and_matches_sequential_bitwise() -> None:
    log, grads, threads = _pipeline_like_step(overlap=True)
    ref_log, ref_grads, _ = _pipeline_like_step(overlap=False)
    # The backward holds the baton first: its first comm point, then the forward's first, and so on alternately.
    assert log[2:6] == ["1F0b:bwd", "F1a:fwd", "1F0a:bwd", "F1b:fwd"]
    assert ref_log[2:6] == ["F1a:fwd", "F1b:fwd", "1F0b:bwd", "1F0a:bwd"]
    assert log[6:] == ref_log[6:] == ["F1b:bwd", "F1a:bwd"]
    assert set(threads) == {"moe-overlap-forward", "moe-overlap-backward"}
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))


def test_an_error_in_a_pair_surfaces_in_the_caller_and_stops_the_partner() -> None:
    runtime, log = CommRuntime(), []
    engine = OverlapEngine(runtime, overlap=True, timeout_s=30)
    x = torch.randn(3, 4, requires_grad=True)
    out = CommPoint.apply(x * 2, runtime, log, "B")

    def failing_forward() -> None:
        CommPoint.apply(x * 3, runtime, log, "F")
        raise ValueError("boom in chunk 2's forward")

    def long_backward() -> None:
        CommPoint.apply(CommPoint.apply(out, runtime, log, "B2"), runtime, log, "B3").sum().backward()

    with pytest.raises(ValueError, match="boom in chunk 2's forward"):
        with engine.step() as step:
            step.run_pair(forward(5, 2), failing_forward, backward(1, 0), long_backward)
    assert "B:bwd" not in log  # the backward context stopped at its next hand-over after the forward failed
