"""The engine on 2 and 4 gloo ranks with a toy expert-parallel model.

Toy layer: Linear -> route each token to one rank (data-dependent, uneven counts) -> all-to-all dispatch -> a
per-rank expert -> all-to-all combine -> Linear, with a residual. Each all-to-all (and the token-count exchange)
is a comm point: issue async, ``runtime.handoff()``, wait; in forward and in backward.

Shapes: T tokens, D hidden, W world size (one expert per rank).
"""

from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass, field
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_moe_overlap.overlap import CommRuntime, OverlapEngine, PeerFailure
from tests.helpers.distributed import run_distributed

D = 8
STEPS = 2


@dataclass
class Probe:
    """What the tests observe and inject: the thread of every comm point, and a failure in the backward."""

    trace: list[str] = field(default_factory=list)
    fail_backward: bool = False


def all_to_all(x: Tensor, send: list[int], recv: list[int], runtime: CommRuntime, probe: Probe) -> Tensor:
    """One comm point: uneven all-to-all along dim 0."""
    probe.trace.append(threading.current_thread().name)
    out = x.new_empty((sum(recv), *x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), recv, send, async_op=True)
    runtime.handoff()
    work.wait()
    return out


class Exchange(torch.autograd.Function):
    """Differentiable uneven all-to-all: the backward sends the gradients back the way the tokens came."""

    @staticmethod
    def forward(ctx, x_TD: Tensor, send: list[int], recv: list[int], runtime: CommRuntime, probe: Probe):  # noqa
        ctx.args = (send, recv, runtime, probe)
        return all_to_all(x_TD, send, recv, runtime, probe)

    @staticmethod
    def backward(ctx, grad_TD: Tensor):  # noqa: ANN001, ANN205
        send, recv, runtime, probe = ctx.args
        if probe.fail_backward:
            raise ValueError("boom in the backward, inside an autograd function")
        return all_to_all(grad_TD, recv, send, runtime, probe), None, None, None, None


class ExpertGemm(torch.autograd.Function):
    """``x @ W.T`` whose weight gradient goes through ``runtime.defer_wgrad`` (inline when that declines)."""

    @staticmethod
    def forward(ctx, x_TD: Tensor, weight_DD: Tensor, runtime: CommRuntime):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x_TD)
        ctx.weight, ctx.runtime = weight_DD, runtime
        return x_TD @ weight_DD.t()

    @staticmethod
    def backward(ctx, grad_TD: Tensor):  # noqa: ANN001, ANN205
        (x_TD,) = ctx.saved_tensors
        wgrad = partial(accumulate_wgrad, ctx.weight, grad_TD, x_TD)
        if not ctx.runtime.defer_wgrad(wgrad):
            wgrad()
        return grad_TD @ ctx.weight, None, None


def accumulate_wgrad(weight: Tensor, grad_TD: Tensor, x_TD: Tensor) -> None:
    grad = grad_TD.t() @ x_TD
    weight.grad = grad if weight.grad is None else weight.grad + grad


class ToyMoE(nn.Module):
    def __init__(self, runtime: CommRuntime, world_size: int, probe: Probe) -> None:
        super().__init__()
        self.runtime, self.world_size, self.probe = runtime, world_size, probe
        self.router = nn.Linear(D, world_size, bias=False)
        self.expert = nn.Parameter(torch.randn(D, D) / D**0.5)  # this rank's expert

    def forward(self, h_TD: Tensor) -> Tensor:
        W, comm = self.world_size, (self.runtime, self.probe)
        probs_TW = self.router(h_TD).softmax(-1)
        dest_T = probs_TW.argmax(-1)
        order_T = dest_T.argsort(stable=True)
        send_W = torch.bincount(dest_T, minlength=W)
        recv = all_to_all(send_W, [1] * W, [1] * W, *comm).tolist()  # token counts: a comm point too
        send = send_W.tolist()
        x_TD = Exchange.apply(h_TD[order_T], send, recv, *comm)
        y_TD = ExpertGemm.apply(x_TD, self.expert, self.runtime).tanh()
        back_TD = Exchange.apply(y_TD, recv, send, *comm)
        return back_TD[order_T.argsort()] * probs_TW.gather(1, dest_T[:, None])


class ToyLayer(nn.Module):
    def __init__(self, runtime: CommRuntime, world_size: int, probe: Probe, recompute: str | None) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(D, D), nn.Linear(D, D)
        self.moe = ToyMoE(runtime, world_size, probe)
        self.recompute = recompute

    def forward(self, x_TD: Tensor) -> Tensor:
        if self.recompute == "moe":  # a sub-module containing comm points
            moe = partial(checkpoint, self.moe, use_reentrant=False)
        else:
            moe = self.moe
        return x_TD + self.out(moe(self.inp(x_TD)))


class ToyModel(nn.Module):
    def __init__(self, runtime: CommRuntime, world_size: int, recompute: str | None, layers: int = 2) -> None:
        super().__init__()
        self.probe = Probe()
        self.recompute = recompute
        self.embed = nn.Linear(D, D)  # so that a checkpointed first layer has an input that requires grad
        self.layers = nn.ModuleList(ToyLayer(runtime, world_size, self.probe, recompute) for _ in range(layers))

    def forward(self, x_TD: Tensor) -> Tensor:
        x_TD = self.embed(x_TD)
        for layer in self.layers:
            if self.recompute in ("layer", "layer-reentrant"):
                x_TD = checkpoint(layer, x_TD, use_reentrant=self.recompute == "layer-reentrant")
            else:
                x_TD = layer(x_TD)
        return x_TD


def build(rank: int, world_size: int, recompute: str | None, delay_wgrad: bool) -> tuple[ToyModel, CommRuntime]:
    runtime = CommRuntime(delay_wgrad=delay_wgrad)
    torch.manual_seed(0)  # dense weights equal on every rank ...
    model = ToyModel(runtime, world_size, recompute)
    torch.manual_seed(100 + rank)  # ... experts differ per rank
    for layer in model.layers:
        nn.init.normal_(layer.moe.expert, std=D**-0.5)
    return model, runtime


def microbatches(rank: int, step: int, count: int) -> list[Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return [torch.randn(3 + (i + rank) % 4, D, generator=generator) for i in range(count)]


def train(model: ToyModel, engine: OverlapEngine, rank: int, count: int) -> list[list[Tensor]]:
    """A few SGD steps; returns the gradients of each step and the final parameters."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    record = []
    for step in range(STEPS):
        data = microbatches(rank, step, count)
        optimizer.zero_grad(set_to_none=True)
        losses = engine.run(lambda i: model(data[i]).square().mean(), lambda i, loss: loss.backward(), count)
        record.append([torch.stack(losses)] + [p.grad.clone() for p in model.parameters()])
        optimizer.step()
    record.append([p.detach().clone() for p in model.parameters()])
    return record


def lane_switches(trace: list[str]) -> int:
    return sum(a != b for a, b in zip(trace, trace[1:]))


Config = tuple[int, "str | None", bool]  # micro-batches, recompute, delay_wgrad
ALL_CONFIGS: list[Config] = [
    (count, recompute, delay)
    for count in (1, 2, 5)
    for recompute in (None, "layer", "layer-reentrant", "moe")
    for delay in (False, True)
]
# On 4 ranks (slower on a small machine): every M, every recompute mode and both wgrad modes, not all combinations.
COVERING_CONFIGS: list[Config] = [
    (1, None, False), (1, "layer-reentrant", True), (2, "layer", True), (2, "moe", False),
    (5, None, True), (5, "layer-reentrant", False), (5, "moe", True),
]


def bitwise_worker(rank: int, world_size: int, configs: list[Config]) -> list[str]:
    """Each config: overlapped vs sequential, bitwise. Returns the mismatches (empty when all equal)."""
    problems = []
    for count, recompute, delay in configs:
        results, switches = {}, {}
        for overlap in (False, True):
            model, runtime = build(rank, world_size, recompute, delay)  # identical initial weights both times
            engine = OverlapEngine(runtime, overlap=overlap, timeout_s=60)
            results[overlap] = train(model, engine, rank, count)
            switches[overlap] = lane_switches(model.probe.trace)
        name = f"M={count} recompute={recompute} delay_wgrad={delay}"
        for step, (seq, ovl) in enumerate(zip(results[False], results[True], strict=True)):
            if not all(torch.equal(a, b) for a, b in zip(seq, ovl, strict=True)):
                problems.append(f"{name}: {'params' if step == STEPS else f'step {step}'} differ")
        if count > 1 and switches[True] <= switches[False]:
            problems.append(f"{name}: contexts did not interleave ({switches[True]} vs {switches[False]} switches)")
    return problems


@pytest.mark.parametrize(
    ("world_size", "configs"),
    [(2, ALL_CONFIGS), pytest.param(4, COVERING_CONFIGS, marks=pytest.mark.long)],  # 4 ranks: test_overlap_bitwise
    ids=["2ranks", "4ranks"],
)
def test_overlapped_bitwise_equal_to_sequential(world_size: int, configs: list[Config]) -> None:
    problems = run_distributed(bitwise_worker, world_size, configs, timeout_s=60)
    assert problems == [[]] * world_size


def failing_worker(rank: int, world_size: int, culprit: int, where: str) -> dict:
    """One good step, then a step where ``culprit`` raises in its forward or backward context."""
    model, runtime = build(rank, world_size, "layer", delay_wgrad=True)
    engine = OverlapEngine(runtime, overlap=True, timeout_s=60, failure_poll_s=0.2)
    train(model, engine, rank, 3)  # good steps first: the failure reports are keyed by step

    def forward(i: int) -> Tensor:
        if rank == culprit and where == "forward" and i == 2:
            model.layers[0](data[i])  # some comm points, then fail inside the forward context
            raise ValueError("boom in the forward, between two comm points")
        return model(data[i]).square().mean()

    def backward(i: int, loss: Tensor) -> None:
        model.probe.fail_backward = rank == culprit and where == "backward" and i == 1
        loss.backward()

    data = microbatches(rank, 7, 3)
    start = time.monotonic()
    try:
        engine.run(forward, backward, 3)
    except Exception as err:  # noqa: BLE001 - inspected by the test
        cause, frame = err.__cause__, traceback.extract_tb(err.__traceback__)[-1]
        return {
            "type": type(err).__name__,
            "message": str(err),
            "cause": None if cause is None else f"{type(cause).__name__}: {cause}",
            "raised_at": f"{frame.name}: {frame.line}",
            "elapsed": time.monotonic() - start,
        }
    return {"type": None, "elapsed": time.monotonic() - start}


PG_TIMEOUT_S = 10.0


@pytest.mark.parametrize(
    ("world_size", "culprit", "where", "raising_frame"),
    [
        (2, 0, "forward", "forward: raise ValueError"),
        pytest.param(4, 2, "backward", "backward: raise ValueError", marks=pytest.mark.long),
    ],
    ids=["2ranks-store-host-fails-in-forward", "4ranks-rank2-fails-in-autograd-backward"],
)
def test_failure_on_one_rank_ends_every_rank_with_its_message(
    world_size: int, culprit: int, where: str, raising_frame: str
) -> None:
    results = run_distributed(failing_worker, world_size, culprit, where, timeout_s=PG_TIMEOUT_S)
    failed = results[culprit]
    assert failed["type"] == "ValueError" and f"boom in the {where}" in failed["message"]
    assert failed["raised_at"].startswith(raising_frame)  # the original traceback, down to the raising line
    expected = f"rank {culprit}: ValueError: boom"
    for rank, result in enumerate(results):
        assert result["elapsed"] < PG_TIMEOUT_S, (rank, result)  # no rank waits out its collectives' timeout
        if rank != culprit:
            assert result["type"] == PeerFailure.__name__, (rank, result)
            assert expected in result["message"], (rank, result)
