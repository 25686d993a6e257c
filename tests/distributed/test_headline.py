"""The design card's headline line, `MoEOverlapStrategy(ep=8, vpp=2)`, constructs and trains on 8 processes."""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo import MoEGPT, SyntheticTokens
from tests.helpers.distributed import run_distributed


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy = MoEOverlapStrategy(ep=8, vpp=2)
    model = MoEGPT(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_experts=8, top_k=2, ffn_hidden_size=16)
    trainer = Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )
    trainer.fit(model, datamodule=SyntheticTokens(vocab_size=64, seq_len=8, batch_size=2))
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    local_experts = {p.to_local().shape[0] for p in experts}
    global_experts = {p.shape[0] for p in experts}
    return {
        "step": trainer.global_step,
        "warnings": [str(w.message) for w in caught],
        "ep": strategy.dims.ep,
        "local_experts": local_experts,
        "global_experts": global_experts,
    }


@pytest.mark.procs8  # 8 processes: `python -m pytest -m procs8`
def test_headline_ep8_vpp2_runs_on_eight_processes():
    results = run_distributed(_worker, 8, timeout_s=120)
    for r in results:
        assert r["step"] == 2 and r["ep"] == 8
        assert r["local_experts"] == {1}  # 8 experts over ep=8: one per rank
        assert r["global_experts"] == {8}  # DTensors of the global shape
        assert any("`vpp=2` with `pp=1`: there is no pipeline" in w for w in r["warnings"])
