"""Lightning's "`weights_only` was not set" line, logged by every rank at every ``trainer.save_checkpoint(path)``,
reaches the console once on 2 gloo ranks: by global rank 0, at the first save."""

from __future__ import annotations

import logging
from pathlib import Path

from lightning.pytorch import Trainer

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap._noise import ONCE_PER_PROCESS_LOGS
from lightning_moe_overlap.demo import MoEGPT, SyntheticTokens
from tests.helpers.distributed import run_distributed
from tests.helpers.records import LogRecords

LOGGER, WEIGHTS_ONLY = ONCE_PER_PROCESS_LOGS[0]


def _worker(rank: int, world: int, root: Path) -> list[str]:
    records = LogRecords()
    logging.getLogger(LOGGER).addHandler(records)  # what reaches Lightning's console handler
    model = MoEGPT(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_experts=4, ffn_hidden_size=16)
    trainer = Trainer(
        accelerator="cpu", devices=world, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        strategy=MoEOverlapStrategy(ep=2, num_microbatches=2),
    )
    trainer.fit(model, datamodule=SyntheticTokens(vocab_size=32, seq_len=8, batch_size=4))
    trainer.save_checkpoint(root / "a")
    trainer.save_checkpoint(root / "b")
    return records.messages


def test_weights_only_not_set_is_logged_once_by_rank_zero(tmp_path) -> None:
    logged = run_distributed(_worker, 2, tmp_path, timeout_s=120)
    assert [messages.count(WEIGHTS_ONLY) for messages in logged] == [1, 0]
    assert (tmp_path / "a").is_dir() and (tmp_path / "b").is_dir()  # both saves happened
