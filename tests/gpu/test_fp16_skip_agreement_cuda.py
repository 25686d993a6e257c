"""``16-mixed`` on CUDA under ``MoEOverlapStrategy(ep=2)``: an ``inf`` in ONE rank's expert gradient makes EVERY rank
skip the step and keep the same loss scale.

Two processes share ``cuda:0`` over gloo, presented to Lightning as two nodes of one device each. The model, the
planted overflow and the oracles are those of ``tests/distributed/test_fp16_skip_agreement.py``; here the
``GradScaler`` and its ``found_inf`` live on the GPU.
"""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_moe_overlap import MoEOverlapStrategy
from tests.distributed.test_fp16_skip_agreement import INIT_SCALE, MICRO, Planted
from tests.helpers.distributed import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="Requires: CUDA (GradScaler on the GPU)"),
]


class _OnCuda(Planted):
    """Records the device the parameters train on (Lightning moves the module back to the CPU after ``fit``)."""

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.trained_on = str(next(self.parameters()).device)
        super().on_train_batch_end(outputs, batch, batch_idx)


def _worker(rank: int, world: int) -> dict:
    os.environ.update(LOCAL_RANK="0", NODE_RANK=str(rank))  # one device per "node": both ranks on cuda:0
    torch.cuda.set_device(0)
    model = _OnCuda()
    scaler = torch.amp.GradScaler("cuda", init_scale=INIT_SCALE, growth_interval=1000)
    trainer = Trainer(
        accelerator="cuda", devices=1, num_nodes=world, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        plugins=[MixedPrecision("16-mixed", "cuda", scaler=scaler)],
        strategy=MoEOverlapStrategy(ep=2, num_microbatches=MICRO, process_group_backend="gloo"),
    )
    initial = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    trainer.fit(model)
    names = [n for n, _ in model.named_parameters()]
    first = dict(zip(names, model.after_step[0]))
    dense = [n for n in names if ".experts." not in n]
    return {
        "scales": model.scales,
        "dense_unchanged": sum(torch.equal(first[n].cpu(), initial[n]) for n in dense),
        "dense": len(dense),
        "device": model.trained_on,
        "dense_end": {n: t.cpu() for n, t in zip(names, model.after_step[-1]) if ".experts." not in n},
    }


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank_on_cuda() -> None:
    results = run_distributed(_worker, 2, timeout_s=240)
    for rank, r in enumerate(results):
        assert r["device"] == "cuda:0", r["device"]
        assert r["scales"][0] == INIT_SCALE * 0.5, (rank, r["scales"])
        assert r["dense_unchanged"] == r["dense"], (rank, r["dense_unchanged"], r["dense"])
    assert results[0]["scales"] == results[1]["scales"]
    for name, value in results[0]["dense_end"].items():
        assert torch.equal(value, results[1]["dense_end"][name]), name
