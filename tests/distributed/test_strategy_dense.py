"""MoEOverlapStrategy on a dense model, 4 gloo ranks: data split over dp, collectives, and the global-batch oracle."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from torch import nn
from torch.utils.data import DistributedSampler

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.parallel.dtensors import local
from tests.helpers.distributed import run_distributed
from tests.helpers.models import DenseRegressor, IndexedRegression

STEPS, BATCH, WORLD = 3, 4, 4


def _trainer(strategy, world: int, **kwargs) -> Trainer:
    return Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def _fit(rank: int, world: int, strategy_spec) -> dict:
    strategy = strategy_spec if isinstance(strategy_spec, str) else MoEOverlapStrategy(**strategy_spec)
    model = DenseRegressor(dtype=torch.float64, batch_size=BATCH)
    trainer = _trainer(strategy, world)
    trainer.fit(model)
    s = trainer.strategy
    assert isinstance(s, MoEOverlapStrategy)
    assert model.parallel_groups is s.parallel_groups  # handed to the module before configure_model
    reduced_sum = s.reduce(torch.tensor(float(rank + 1)), reduce_op="sum").item()
    reduced_mean = s.reduce(torch.tensor(float(rank + 1))).item()
    s.barrier()
    return {
        "seen": model.seen,
        "params": [local(p).detach().clone() for p in model.parameters()],
        "sum": reduced_sum,
        "mean": reduced_mean,
        "bcast": s.broadcast({"from": rank, "payload": [rank] * 3}, src=2),
        "sampler": s.distributed_sampler_kwargs,
        "global_step": trainer.global_step,
        "ep": s.dims.ep,
    }


def _single_process_reference(seen_per_rank: list[list[int]]) -> list[torch.Tensor]:
    """Plain SGD on each step's global batch (the union of every rank's batch at that step)."""
    model = DenseRegressor(dtype=torch.float64, batch_size=BATCH)
    data = IndexedRegression(dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=model.lr)
    for step in range(STEPS):
        idx = [i for seen in seen_per_rank for i in seen[step * BATCH : (step + 1) * BATCH]]
        opt.zero_grad()
        per_rank = [nn.functional.mse_loss(model.net(data.x[idx[r * BATCH : (r + 1) * BATCH]]),
                                           data.y[idx[r * BATCH : (r + 1) * BATCH]]) for r in range(len(seen_per_rank))]
        torch.stack(per_rank).mean().backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def _bad_world_message(world: int) -> str:
    try:
        _trainer(MoEOverlapStrategy(ep=3, num_microbatches=2), world)
    except ValueError as err:
        return f"ValueError: {err}"
    return "no error"


def _worker_all(rank: int, world: int) -> dict:
    """One spawn for every scenario of this file (importing Lightning dominates the cost of a spawn)."""
    return {
        "instance": _fit(rank, world, {"ep": 2}),
        "registered": _fit(rank, world, "moe_overlap"),
        "bad_world": _bad_world_message(world),
    }


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_worker_all, WORLD, timeout_s=60)


@pytest.mark.parametrize("key", ["instance", "registered"])
def test_strategy_fits_dense_model_on_four_ranks(results, key):
    ep = 2 if key == "instance" else 1
    results = [r[key] for r in results]
    for rank, res in enumerate(results):
        assert res["global_step"] == STEPS
        assert res["sampler"] == {"num_replicas": WORLD, "rank": rank}  # dp == world here: tp = pp = cp = 1
        assert res["sum"] == sum(range(1, WORLD + 1))
        assert res["mean"] == sum(range(1, WORLD + 1)) / WORLD
        assert res["bcast"] == {"from": 2, "payload": [2, 2, 2]}
        assert res["ep"] == ep
    seen = [res["seen"] for res in results]
    flat = [i for s in seen for i in s]
    assert len(flat) == len(set(flat)) == WORLD * STEPS * BATCH  # disjoint shards, nothing read twice
    data = IndexedRegression()
    for rank in range(WORLD):  # exactly the shard a DistributedSampler over the dp group gives this rank
        shard = list(DistributedSampler(data, num_replicas=WORLD, rank=rank, shuffle=True, seed=0))
        assert seen[rank] == shard[: STEPS * BATCH]
    reference = _single_process_reference(seen)
    for res in results:  # replicas stay identical and equal to the single-process global-batch run
        for got, want in zip(res["params"], reference):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_strategy_invalid_world_fails_on_every_rank_with_same_message(results):
    messages = {r["bad_world"] for r in results}
    assert len(messages) == 1  # identical on all 4 ranks, raised at Trainer construction (before any collective)
    assert "ep=3 does not divide dp*cp*tp=4 (dp=4, cp=1, tp=1, world_size=4)" in messages.pop()
