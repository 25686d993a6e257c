"""The overlapped schedule is bitwise equal to the sequential one, on real expert-parallel MoE layers.

One spawn of 4 gloo ranks runs the whole matrix: ep in {2, 4}, micro-batches in {2, 5}, top-k in {1, 2},
recompute off / whole-layer checkpoint (plus ep=1 and one micro-batch, each twice), sub-module checkpoint,
dispatcher alltoall (deduplicated: `dedup=True`;
its plain path ``alltoall:plain``, top-k 3 and allgather for a subset),
each trained for a few SGD steps three ways: sequential, overlapped, overlapped with delayed wgrad. The parameters
after the steps must be ``torch.equal`` on every rank.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_moe_overlap.parallel.grads import sync_gradients
from lightning_moe_overlap.moe.ep import apply_expert_parallel
from lightning_moe_overlap.moe.layer import MoELayer
from lightning_moe_overlap.overlap.engine import OverlapEngine
from lightning_moe_overlap.overlap.runtime import CommRuntime
from lightning_moe_overlap.parallel import ParallelDims
from tests.helpers.distributed import mesh_groups, run_distributed

WORLD, STEPS, D, TOKENS = 4, 2, 16, 10


class Block(nn.Module):
    def __init__(self, top_k: int, recompute: str) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.proj = nn.Linear(D, D)
        self.moe = MoELayer(hidden_size=D, ffn_hidden_size=24, num_experts=4, top_k=top_k, aux_loss_coeff=1e-2)
        self.recompute = recompute

    def _inner(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(self.norm(torch.tanh(self.proj(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute == "moe":  # a sub-module holding comm points is recomputed inside backward
            return x + checkpoint(self._inner, x, use_reentrant=False)
        return x + self._inner(x)


class Net(nn.Module):
    def __init__(self, top_k: int, recompute: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(top_k, recompute) for _ in range(2))
        self.head = nn.Linear(D, 1)
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.recompute == "layer" else block(x)
        return self.head(x)


def _train(rank, groups, ep, micro, top_k, recompute, dispatcher, overlap, delay_wgrad) -> list[torch.Tensor]:
    runtime = CommRuntime(delay_wgrad=delay_wgrad)
    net = Net(top_k, recompute)
    name, _, variant = dispatcher.partition(":")
    knobs = {"dedup": variant != "plain"}
    experts = apply_expert_parallel(net, groups.ep, dispatcher=name, runtime=runtime, **knobs)
    expert_ids = {id(p) for m in experts for p in m.parameters()}
    dense = [p for p in net.parameters() if id(p) not in expert_ids]
    local = [p for p in net.parameters() if id(p) in expert_ids]
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    engine = OverlapEngine(runtime, overlap=overlap, timeout_s=120)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        x = torch.randn(micro, TOKENS, D, generator=g)
        y = torch.randn(micro, TOKENS, 1, generator=g)
        if rank == 0:  # every token to one expert on this rank: a skewed load (some experts get nothing)
            x[:, :, :] = x[:, :1, :]
        opt.zero_grad()
        engine.run(
            lambda i: nn.functional.mse_loss(net(x[i]), y[i]),
            lambda i, loss: (loss / micro).backward(),
            micro,
        )
        assert runtime.pending_wgrad == 0
        sync_gradients(dense, local, dp_cp_group=groups.dp_cp, edp_group=groups.edp, dp_cp_size=WORLD)
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def _worker_matrix(rank: int, world: int, cases: list[tuple]) -> int:
    torch.use_deterministic_algorithms(True)
    groups_by_ep = {ep: mesh_groups(ParallelDims.from_world_size(world, ep=ep), rank) for ep in (1, 2, 4)}
    checked = 0
    for ep, micro, top_k, recompute, dispatcher in cases:
        args = (rank, groups_by_ep[ep], ep, micro, top_k, recompute, dispatcher)
        reference = _train(*args, overlap=False, delay_wgrad=False)
        for overlap, delay in ((True, False), (True, True), (False, True)):
            got = _train(*args, overlap=overlap, delay_wgrad=delay)
            for i, (a, b) in enumerate(zip(got, reference)):
                assert torch.equal(a, b), (
                    f"rank {rank} ep={ep} M={micro} k={top_k} recompute={recompute} {dispatcher} "
                    f"overlap={overlap} delay_wgrad={delay}: parameter {i} differs by {(a - b).abs().max()}"
                )
            checked += 1
    return checked


PRODUCT = [
    (ep, micro, top_k, recompute, "alltoall")
    for ep, micro, top_k, recompute in itertools.product((2, 4), (2, 5), (1, 2), ("none", "layer"))
]
EDGES = [
    (1, 2, 2, "none", "alltoall"),  # ep=1: no all-to-all crosses processes
    (1, 5, 1, "layer", "alltoall"),
    (2, 1, 2, "none", "alltoall"),  # one micro-batch: nothing to pair, the schedule is the sequential one
    (4, 1, 1, "layer", "alltoall"),

    (2, 3, 2, "moe", "alltoall"),
    (4, 2, 1, "moe", "alltoall"),
    (2, 3, 2, "moe", "alltoall:plain"),
    (4, 2, 2, "layer", "alltoall:plain"),
    (2, 3, 3, "none", "alltoall"),  # three choices on two ranks: two always share one
    (2, 2, 2, "none", "allgather"),
    (4, 5, 2, "layer", "allgather"),
    (4, 3, 2, "moe", "allgather"),
]


@pytest.mark.parametrize(
    "cases", [EDGES, pytest.param(PRODUCT, marks=pytest.mark.long)], ids=["edge-cases", "ep-micro-topk-recompute"]
)
def test_overlap_bitwise_equals_sequential_matrix(cases):
    results = run_distributed(_worker_matrix, WORLD, cases, timeout_s=120)
    assert results == [3 * len(cases)] * WORLD
