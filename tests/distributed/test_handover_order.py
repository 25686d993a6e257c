"""The order of issue, host read, hand-over and resume per layer and micro-batch, on two gloo ranks (ep=2).

A model of three ``MoELayer`` blocks runs one overlapped step of three micro-batches (``F0, F1|B0, F2|B1, B2``)
under the engine, with a :class:`~lightning_moe_overlap.overlap.order.CommOrder` attached. The oracle is the
sequence each dispatcher's docstring states, written out here per layer: the host reads of split sizes come after a
hand-over and its resume, never between a comm point's issue and its hand-over; the backward reads nothing. With
``shared_expert_overlap`` the shared experts run inside the token dispatch's window (after its issue, before its
hand-over), not at the count exchange's, in every layer and micro-batch, and in the task that submitted them (the
block's start is marked in the same task's sequence): in a sequential schedule, as the strategy requires, and in
the overlapped one, where the count exchange's hand-over passes the baton to a backward with the shared experts
still queued (its comm points run only its own queue).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lightning_moe_overlap.moe import MoELayer, apply_expert_parallel
from lightning_moe_overlap.overlap.engine import OverlapEngine
from lightning_moe_overlap.overlap.order import CommOrder
from lightning_moe_overlap.overlap.runtime import CommRuntime
from tests.helpers.distributed import run_distributed

D, LAYERS, MICRO = 16, 3, 3
POINT = ["issue", "handoff", "resume"]  # one comm point under a schedule
READ = ["host_read"]
# Per layer forward, from the dispatchers' docstrings (counts, tokens, combine / sizes, tokens, weights, indices,
# combine), the host reads where each says it reads.
FORWARD = {
    "alltoall": POINT + READ + POINT + POINT,
    "allgather": POINT + READ + POINT + POINT + POINT + READ + POINT,
}
# alltoall with shared experts: the block submits them, the count exchange holds them, the token dispatch runs them.
SHARED_FORWARD = ["block"] + POINT + READ + ["issue", "shared", "handoff", "resume"] + POINT


class Net(nn.Module):
    def __init__(self, shared: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        extra = {"shared_expert_ffn_hidden_size": 12, "shared_expert_overlap": True} if shared else {}
        self.embed = nn.Linear(D, D)  # so that the first layer's dispatch has a backward too
        self.blocks = nn.ModuleList(MoELayer(D, 24, 4, 2, aux_loss_coeff=1e-2, **extra) for _ in range(LAYERS))
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(torch.tanh(x))
        return self.head(x)


def _record(rank: int, group: dist.ProcessGroup, dispatcher: str, shared: bool, overlap: bool) -> dict:
    runtime = CommRuntime()
    net = Net(shared)
    apply_expert_parallel(net, group, dispatcher=dispatcher, runtime=runtime)
    order = CommOrder()
    for block in net.blocks:
        if block.shared_experts is not None:
            block.register_forward_pre_hook(lambda *_: order.mark("block"))  # where the block submits them
            block.shared_experts.register_forward_hook(lambda *_: order.mark("shared"))
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(MICRO, 5 + 3 * rank, D, generator=g)  # uneven token counts
    engine = OverlapEngine(runtime, overlap=overlap, timeout_s=60)
    with runtime.attach(order):
        engine.run(lambda i: net(x[i]).square().mean(), lambda i, loss: loss.backward(), MICRO)
    return {"events": order.events, "bad": order.host_reads_before_handoff()}


def _worker(rank: int, world_size: int) -> dict:
    group = dist.new_group(list(range(world_size)))
    return {
        "alltoall": _record(rank, group, "alltoall", shared=False, overlap=True),
        "allgather": _record(rank, group, "allgather", shared=False, overlap=True),
        "shared": _record(rank, group, "alltoall", shared=True, overlap=False),
        "shared_overlapped": _record(rank, group, "alltoall", shared=True, overlap=True),
    }


def test_host_reads_follow_the_handover_and_shared_experts_run_in_the_token_window() -> None:
    for rank, results in enumerate(run_distributed(_worker, 2, timeout_s=120)):
        for case, got in results.items():
            events, forward = got["events"], SHARED_FORWARD if case.startswith("shared") else FORWARD[case]
            assert got["bad"] == [], (rank, case, got["bad"])
            assert sorted(events) == sorted([f"F{i}" for i in range(MICRO)] + [f"B{i}" for i in range(MICRO)])
            for i in range(MICRO):
                assert events[f"F{i}"] == forward * LAYERS, (rank, case, i, events[f"F{i}"])
                backward = events[f"B{i}"]
                assert not {"host_read", "shared", "block"} & set(backward), (rank, case, i, backward)
                # Balanced hand-overs: the backward hands over as often as the forward.
                assert backward.count("handoff") == events[f"F{i}"].count("handoff"), (rank, case, i)
