"""A 2-process ``MoEGPT`` run (ep=2, the process group's timeout 10 minutes) that saves a checkpoint every step, for
``tests/distributed/test_sigterm.py``: ``python -m tests.helpers.sigterm_run ROOT MODE``.

Every DCP save first writes ``ROOT/saving-<local rank>-<n>`` (the process id); with ``SLOW_SAVE=1`` rank 1 then sleeps 2
s inside it, so a signal sent once ``saving-0-<n>`` appears lands while rank 0 waits in the save's collectives. With
``ASYNC_SAVE=1`` the strategy saves in the background (``async_save=True``): the DCP save, and the sleep, run in the
save's thread while the steps go on. ``MODE``: ``run`` (train up to 4 steps), ``resume`` (from ``ckpt_path="last"``, up
to 3 steps); each writes ``ROOT/<mode>.json`` with the global step it started from and the losses it logged, if it ends.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict_saver as dcp_saver
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo import MoEGPT, SyntheticTokens

_original_save = dcp.save


class Record(Callback):
    def __init__(self) -> None:
        self.start: int | None = None
        self.losses: list[float] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def slow_save(root: Path):
    count = {"n": 0}

    def save(*args, **kwargs):
        rank = int(os.environ.get("LOCAL_RANK", "0"))
        count["n"] += 1
        (root / f"saving-{rank}-{count['n']}").write_text(str(os.getpid()))
        if rank == 1 and os.environ.get("SLOW_SAVE") == "1":
            time.sleep(2)
        return _original_save(*args, **kwargs)

    return save


def main(root: Path, mode: str) -> None:
    dcp.save = dcp_saver.save = slow_save(root)  # the second: what `async_save`'s thread calls
    torch.manual_seed(0)
    model = MoEGPT(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, num_experts=4, top_k=2,
                   ffn_hidden_size=16, seed=0)  # fmt: skip
    record = Record()
    checkpoints = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1, save_last=True, save_top_k=-1)
    trainer = Trainer(
        accelerator="cpu", devices=2, max_steps=4 if mode == "run" else 3, logger=False, enable_progress_bar=False,
        enable_model_summary=False,
        strategy=MoEOverlapStrategy(
            ep=2, timeout=timedelta(minutes=10), async_save=os.environ.get("ASYNC_SAVE") == "1"
        ),
        callbacks=[checkpoints, record],
    )  # fmt: skip
    data = SyntheticTokens(vocab_size=64, seq_len=8, batch_size=4, num_samples=400)
    trainer.fit(model, datamodule=data, ckpt_path="last" if mode == "resume" else None)
    if trainer.is_global_zero:
        (root / f"{mode}.json").write_text(json.dumps({"start": record.start, "losses": record.losses}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
