"""Tensor parallelism at 8 gloo ranks: MoEOverlapStrategy(tp=2, ep=4), dp=4; ep folds over dp x tp (edp=2).

Oracles: a single process training the unsplit ``MoEGPT`` on the same global batches (its own loss, aux loss and
shared expert included); the overlapped schedule bitwise equal to the sequential one.

Eight processes on a 2-core machine: marked ``procs8`` and left out of the default run (``python -m pytest -m
procs8``).
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from torch.distributed.tensor import DTensor

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo import MoEGPT
from tests.distributed.test_tensor_parallel import GPT, GPT_CONFIG, MICRO, STEPS, _reference
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.procs8

WORLD, TP, EP = 8, 2, 4


def _fit(**kwargs) -> dict:
    torch.manual_seed(0)
    model = GPT()
    losses: list[float] = []
    trainer = Trainer(
        accelerator="cpu", devices=WORLD, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        strategy=MoEOverlapStrategy(num_microbatches=MICRO, tp=TP, ep=EP, **kwargs),
    )
    model.on_train_batch_end = lambda outputs, *_: losses.append(float(outputs["loss"]))
    trainer.fit(model)
    state = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
             for n, p in model.named_parameters()}  # fmt: skip
    groups = trainer.strategy.parallel_mesh.dims
    return {"losses": losses, "seen": model.seen, "state": state, "dims": (groups.dp, groups.tp, groups.ep)}


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    return {"gpt": _fit(overlap=False), "gpt_overlap": _fit(overlap=True)}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_worker, WORLD, timeout_s=600)


def test_moegpt_at_tp2_ep4_follows_one_process(results):
    runs = [r["gpt"] for r in results]
    assert runs[0]["dims"] == (4, 2, 4)
    seen_per_dp = [runs[r]["seen"] for r in range(0, WORLD, TP)]  # tp peers train on the same samples
    assert all(runs[r]["seen"] == runs[r + 1]["seen"] for r in range(0, WORLD, TP))
    assert len({tuple(s) for s in seen_per_dp}) == WORLD // TP

    def loss_of(model, tokens):
        logits = model(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    torch.manual_seed(0)
    model = MoEGPT(**GPT_CONFIG, seed=3)
    ref = _reference(model, loss_of, seen_per_dp, GPT.seq)
    dist_losses = [sum(run["losses"][s] for run in runs[::TP]) / (WORLD // TP) for s in range(STEPS)]
    torch.testing.assert_close(torch.tensor(dist_losses), torch.tensor(ref), rtol=1e-4, atol=0)
    for rank, run in enumerate(runs):
        for name, value in model.state_dict().items():
            if name in run["state"]:
                torch.testing.assert_close(run["state"][name], value, rtol=1e-4, atol=1e-4, msg=f"rank {rank} {name}")


def test_overlap_at_tp2_ep4_is_bitwise_equal_to_sequential(results):
    for r in results:
        assert r["gpt_overlap"]["losses"] == r["gpt"]["losses"]
        for name, value in r["gpt"]["state"].items():
            assert torch.equal(r["gpt_overlap"]["state"][name], value), name
