"""``benchmarks/peer_torchtitan.py``'s communication floor (``comm_step``): the collectives of a step without its
compute. Oracle: our own sequential step at the same shape, counted by the same ``CommTraffic``, issues exactly as
many all-to-alls per rank, and the ranks together hand them exactly as many bytes (dropless top-k: every row goes
out and comes back, whatever the routing); only the split over the ranks differs (the floor's is even, so a rank
sends back as many rows as it sent out). Runs without torchtitan.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import overlap as bench  # noqa: E402
import peer_torchtitan as peer  # noqa: E402

from lightning_moe_overlap.parallel import ParallelDims  # noqa: E402
from tests.helpers.distributed import mesh_groups, run_distributed  # noqa: E402

CFG = bench.Config(ranks=2, layers=2, hidden=16, ffn=8, dense_ffn=8, experts=4, top_k=2, tokens=6, microbatches=3)


def _model_and_floor(rank: int, world_size: int) -> dict:
    cpu = torch.device("cpu")
    groups = mesh_groups(ParallelDims.from_world_size(world_size, ep=world_size), rank)
    t = bench.build_trainer(CFG, "sequential", groups, cpu)
    x, y = bench.make_batch(CFG, rank, cpu)
    t.traffic.reset()
    t.engine.run(
        lambda i: nn.functional.mse_loss(t.net(x[i]), y[i]), lambda i, loss: loss.backward(), CFG.microbatches
    )
    model = t.traffic.reset()
    floor = peer.comm_floor(CFG, groups, t.dense, t.expert)
    record = peer.comm_step(floor)
    return {
        "model": model,
        "floor": floor.traffic.reset(),
        "record": record,
        "synced_zeros": all(torch.count_nonzero(p.grad) == 0 for p in floor.dense + floor.expert),
        "shapes": [p.shape for p in t.dense + t.expert] == [p.shape for p in floor.dense + floor.expert],
    }


def test_the_floor_issues_the_collectives_and_bytes_of_our_step_without_the_compute() -> None:
    results = run_distributed(_model_and_floor, 2)
    row_bytes = CFG.hidden * 4
    count_bytes = CFG.experts * 8
    per_block = 4 * CFG.tokens * CFG.top_k * row_bytes + count_bytes  # dispatch, combine and their gradients
    for rank, r in enumerate(results):
        collectives, sent, remote = r["floor"]
        assert collectives == 5 * CFG.layers * CFG.microbatches, (rank, r)
        assert sent == per_block * CFG.layers * CFG.microbatches, (rank, r)
        # even split over 2 ranks: half of every data all-to-all and of the counts leaves the rank
        assert remote == sent // 2, (rank, r)
        assert r["model"][0] == collectives, (rank, r)  # our step: the same all-to-alls
        assert r["record"]["step_s"] > 0 and r["record"]["cpu_s"] >= 0, (rank, r)
        assert r["synced_zeros"] and r["shapes"], (rank, r)
    # our ranks send back the rows their experts received, unevenly: the same bytes over both ranks together
    assert sum(r["model"][1] for r in results) == sum(r["floor"][1] for r in results)
    assert results[0]["model"][1] != results[1]["model"][1]  # (so the check above sees uneven routing)


def test_even_splits() -> None:
    assert peer.even_splits(7, 3) == [3, 2, 2]
    assert peer.even_splits(8, 2) == [4, 4]
    assert peer.even_splits(1, 4) == [1, 0, 0, 0]
