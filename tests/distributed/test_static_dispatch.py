"""The static all-to-all dispatch (``static=True``) on two gloo ranks: no host read in an overlapped step, and the
plain dispatch's results.

Each rank trains two blocks of Hugging Face Qwen3-MoE (``Qwen3MoeSparseMoeBlock``, 8 experts, top-2 and top-8)
for one overlapped step of three micro-batches with the overlap engine, three ways: the plain dispatch as it runs on
CPU (rows in segments, per-segment GEMMs), the plain dispatch in its CUDA layout (rows regrouped by expert, one
grouped GEMM), and the static one. Per rank:

- the static step reads nothing back to the host (``tests/helpers/syncs.py`` counts in every context's thread),
  where the plain one reads once per layer and micro-batch (the counter sees the contexts' threads);
- the loss and every gradient are bitwise the plain dispatch's in its CUDA layout (the same rows reach the same
  grouped GEMM in the same order), and within a reordered-sum tolerance of the CPU layout's;
- with a capacity factor (``MoELayer``, ``capacity_factor=1.0``) the slots hold the experts' capacity: bitwise
  again, nothing dropped by the dispatcher;
- ranks holding different token counts stop with an error naming the rule.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_moe_overlap.moe import MoELayer, apply_expert_parallel
from lightning_moe_overlap.moe.dispatch.alltoall import AllToAllDispatcher
from lightning_moe_overlap.overlap.engine import OverlapEngine
from lightning_moe_overlap.overlap.runtime import CommRuntime
from tests.helpers.distributed import run_distributed, run_distributed_expect_errors
from tests.helpers.syncs import SyncCounter

D, TOKENS, MICRO = 16, 6, 3


class Net(nn.Module):
    def __init__(self, top_k: int, capacity: bool) -> None:
        super().__init__()
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        torch.manual_seed(0)
        config = Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=8, num_experts=8, num_experts_per_tok=top_k)
        config._experts_implementation = "eager"

        def moe() -> nn.Module:
            if capacity:
                return MoELayer(D, 8, 8, top_k, capacity_factor=1.0)
            block = Qwen3MoeSparseMoeBlock(config)
            with torch.no_grad():
                block.gate.weight.normal_()
                block.experts.gate_up_proj.normal_(std=0.2)
                block.experts.down_proj.normal_(std=0.2)
            return block

        self.proj = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        self.moe = nn.ModuleList(moe() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for proj, moe in zip(self.proj, self.moe):
            h = torch.tanh(proj(x))
            out = moe(h)
            x = x + (out[0] if isinstance(out, tuple) else out)
        return x


def _step(net: nn.Module, variant: str, rank: int, group: dist.ProcessGroup) -> dict:
    runtime = CommRuntime()
    apply_expert_parallel(net, group, dispatcher="alltoall", runtime=runtime, static=variant == "static")
    batches = [torch.randn(1, TOKENS, D, generator=torch.Generator().manual_seed(100 * rank + i)) for i in range(MICRO)]
    counter = SyncCounter()
    engine = OverlapEngine(runtime, overlap=True, context_factory=lambda task: counter.thread_counter())
    patched = variant == "plain:cuda-layout"
    segments = AllToAllDispatcher._segments
    if patched:  # the CUDA layout on CPU: received rows regrouped by expert, one grouped GEMM
        AllToAllDispatcher._segments = lambda self, x: False  # type: ignore[method-assign]
    try:
        with counter:
            losses = engine.run(lambda i: net(batches[i]).square().mean(), lambda i, loss: loss.backward(), MICRO)
    finally:
        AllToAllDispatcher._segments = segments  # type: ignore[method-assign]
    usage = [m.dispatcher.static_usage() for m in net.modules() if getattr(getattr(m, "dispatcher", None), "static", 0)]
    return {
        "usage": usage,
        "losses": [loss.detach() for loss in losses],
        "grads": {name: p.grad.clone() for name, p in net.named_parameters() if p.grad is not None},
        "reads": dict(counter.counts),
    }


CASES = [(2, False), (8, False), (2, True)]  # (top-k, capacity factor 1.0 through `MoELayer`)


def _worker(rank: int, world_size: int) -> dict:
    group = dist.new_group(list(range(world_size)))
    results = {}
    for top_k, capacity in CASES:
        base = Net(top_k, capacity)
        results[(top_k, capacity)] = {variant: _step(copy.deepcopy(base), variant, rank, group)
                                      for variant in ("plain", "plain:cuda-layout", "static")}  # fmt: skip
    return results


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    # The CPU layout sums an expert's weight gradient segment by segment (one per source rank) and the grouped GEMM
    # in one pass: float32 sums of at most 2 * TOKENS * MICRO products each, reordered; 1e-5 relative to the entry's
    # scale is 2**-23 times a few hundred terms' bound.
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_worker, 2, timeout_s=180)


@pytest.mark.parametrize(("top_k", "capacity"), CASES)
def test_static_dispatch_reads_nothing_and_matches_the_plain_dispatch(results, top_k: int, capacity: bool) -> None:
    for rank, per_case in enumerate(results):
        got = per_case[(top_k, capacity)]
        plain, cuda_layout, static = got["plain"], got["plain:cuda-layout"], got["static"]
        assert static["reads"] == {}, (rank, static["reads"])
        assert len(static["usage"]) == 2 and plain["usage"] == [], rank
        for usage in static["usage"]:  # the slots hold what the experts keep: nothing dropped, some padding sent
            assert usage.calls == MICRO and usage.dropped == 0 and 0 < usage.rows <= usage.slots, (rank, usage)
            assert (usage.rows < usage.slots) == (top_k < 8), (rank, usage)  # top-8 of 8 fills every slot
        assert plain["reads"] == {"tolist": 2 * MICRO}, (rank, plain["reads"])  # one per layer and micro-batch
        # ... and in the CUDA layout the grouped GEMM's offsets go to the device from that host list (no wait)
        assert cuda_layout["reads"] == {"tolist": 2 * MICRO, "to(device)": 2 * MICRO}, (rank, cuda_layout["reads"])
        assert all(torch.equal(a, b) for a, b in zip(static["losses"], cuda_layout["losses"])), rank
        assert static["grads"].keys() == cuda_layout["grads"].keys() and static["grads"], rank
        for name, grad in static["grads"].items():
            assert torch.equal(grad, cuda_layout["grads"][name]), (rank, name)
            assert _close(grad, plain["grads"][name]), (rank, name)


def _uneven_worker(rank: int, world_size: int) -> None:
    group = dist.new_group(list(range(world_size)))
    layer = MoELayer(D, 8, 4, 2)
    apply_expert_parallel(layer, group, dispatcher="alltoall", static=True)
    layer(torch.randn(4 + rank, D))


def test_static_dispatch_refuses_uneven_token_counts() -> None:
    errors = run_distributed_expect_errors(_uneven_worker, 2)
    assert set(errors) == {0, 1}
    for text in errors.values():
        assert "every ep rank must hold as many" in text and "alltoall_static=False" in text
