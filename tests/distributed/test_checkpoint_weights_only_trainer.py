"""``trainer.fit(ckpt_path=...)`` on 2 gloo ranks runs no code from a checkpoint whose ``meta.pt`` was replaced.

A tiny ``MoEGPT`` (ep=2) trains one step and saves a sharded checkpoint; rank 0 then replaces its ``meta.pt`` by
one that also holds a pickle whose unpickling creates a marker file. Resuming with Lightning's default
``weights_only`` fails on every rank with the file's name and the opt-out, and the marker does not exist: nothing
ran. Resuming with torch's opt-out, ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``, unpickles it (the marker appears: the
plant is live) and trains on.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo import MoEGPT
from tests.helpers.distributed import run_distributed
from tests.helpers.planted import Planted

CONFIG = dict(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2, num_experts=4, top_k=2, ffn_hidden_size=4)


class GPT(MoEGPT):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.randint(0, 16, (8, 9), generator=torch.Generator().manual_seed(0)), batch_size=2)


def _trainer(steps: int) -> Trainer:
    return Trainer(
        accelerator="cpu", devices=2, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=0,
        strategy=MoEOverlapStrategy(ep=2, num_microbatches=1),
    )


def _worker(rank: int, world: int, root: Path) -> dict:
    torch.set_num_threads(1)
    trainer = _trainer(1)
    trainer.fit(GPT(**CONFIG))
    ckpt, marker = root / "ck", root / "ran"
    trainer.save_checkpoint(ckpt)
    if rank == 0:
        meta = torch.load(ckpt / "meta.pt", weights_only=True)
        torch.save({**meta, "planted": Planted(marker)}, ckpt / "meta.pt")
    dist.barrier()
    try:
        _trainer(2).fit(GPT(**CONFIG), ckpt_path=ckpt)
        refusal = "no error"
    except ValueError as err:
        refusal = str(err)
    ran_by_default = marker.exists()
    dist.barrier()
    os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        resumed = _trainer(2)
        resumed.fit(GPT(**CONFIG), ckpt_path=ckpt)
    finally:
        del os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"]
    return {"refusal": refusal, "ran_by_default": ran_by_default, "ran_opted_out": marker.exists(),
            "step": resumed.global_step}


def test_resuming_from_a_planted_checkpoint_runs_nothing_unless_opted_out(tmp_path):
    results = run_distributed(_worker, 2, tmp_path, timeout_s=120)
    meta = tmp_path / "ck" / "meta.pt"
    for rank, got in enumerate(results):
        assert f"the checkpoint file {meta} holds objects of" in got["refusal"], (rank, got["refusal"])
        assert "_plant" in got["refusal"] and "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1" in got["refusal"], rank
        assert not got["ran_by_default"], f"rank {rank}: the planted pickle ran on a default resume"
        assert got["ran_opted_out"] and got["step"] == 2, rank
