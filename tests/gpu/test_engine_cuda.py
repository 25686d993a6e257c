"""The engine with CUDA tensors (one process): backward comm points run on autograd's device thread and still
alternate with the forward's; both contexts use the caller's stream; random streams stay per context, on cuda:1 too."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_moe_overlap.overlap import CommRuntime, run_schedule

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="Requires: CUDA (autograd device threads, streams)"),
]


class Point(torch.autograd.Function):
    """A fake comm point that logs ``(tag, thread name)`` in forward and backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tag: str, runtime: CommRuntime, log: list) -> torch.Tensor:  # noqa: ANN001
        ctx.tag, ctx.runtime, ctx.log = tag, runtime, log
        log.append((tag, threading.current_thread().name))
        runtime.handoff()
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        ctx.log.append((ctx.tag.replace("F", "B"), threading.current_thread().name))
        ctx.runtime.handoff()
        return grad.clone(), None, None, None


def test_backward_on_the_device_thread_alternates_with_forward() -> None:
    runtime, log = CommRuntime(), []
    w = torch.randn(4, device="cuda", requires_grad=True)

    def forward(i: int) -> torch.Tensor:
        h = Point.apply(w * (i + 1), f"F{i}.0", runtime, log)
        return Point.apply(h.sin(), f"F{i}.1", runtime, log).sum()

    run_schedule(forward, lambda i, loss: loss.backward(), 2, runtime, overlap=True)
    assert [tag for tag, _ in log] == ["F0.0", "F0.1", "B0.1", "F1.0", "B0.0", "F1.1", "B1.1", "B1.0"]
    backward_threads = {name for tag, name in log if tag.startswith("B")}
    assert "moe-overlap-backward" not in backward_threads  # the premise: autograd's device thread runs them


def test_contexts_use_the_callers_current_stream() -> None:
    stream, seen = torch.cuda.Stream(), []

    def probe(*_: object) -> None:
        seen.append(torch.cuda.current_stream() == stream)

    with torch.cuda.stream(stream):
        run_schedule(probe, probe, 2, CommRuntime(), overlap=True)
    assert seen == [True] * 4


def _device(index: int) -> int:
    if torch.cuda.device_count() <= index:
        pytest.skip(f"Requires: CUDA with {index + 1} devices (a rank whose GPU is not cuda:0)")
    return index


@pytest.mark.parametrize("index", [0, 1], ids=["cuda:0", "cuda:1"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_dropout_under_recompute_bitwise_equal_to_sequential(reentrant: bool, index: int) -> None:
    with torch.cuda.device(_device(index)):  # the lanes are new threads: their current device is cuda:0
        _dropout_under_recompute(reentrant)


def _dropout_under_recompute(reentrant: bool) -> None:
    runtime = CommRuntime()
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.3)).cuda()
    grads = {}
    for overlap in (False, True):
        torch.manual_seed(1)
        first = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.3)).cuda()  # same weights both runs (seeded)
        block.zero_grad(set_to_none=True)
        data = [torch.randn(8, 16, device="cuda") for _ in range(3)]

        def forward(i: int) -> torch.Tensor:
            h = Point.apply(first(data[i]), f"F{i}.0", runtime, [])
            h = checkpoint(lambda x: Point.apply(block(x), f"F{i}.1", runtime, []), h, use_reentrant=reentrant)
            return nn.functional.dropout(h, 0.3).square().mean()  # drawn after the last hand-over

        run_schedule(forward, lambda i, loss: loss.backward(), len(data), runtime, overlap=overlap)
        grads[overlap] = [p.grad.clone() for p in block.parameters()] + [torch.cuda.get_rng_state()]
        grads[overlap].append(first[0].weight.grad.clone())  # depends on the forward's masks
    for a, b in zip(grads[False], grads[True], strict=True):
        assert torch.equal(a, b)
