"""``SelectiveRecompute`` and ``ActivationOffload`` say on rank 0 what they attached at fit start: the count of
regions they installed, which the test counts itself from the callback's own handles after the fit started."""

from __future__ import annotations

import logging

import pytest
from lightning.pytorch import Trainer

from lightning_moe_overlap import ActivationOffload, SelectiveRecompute
from lightning_moe_overlap.demo import MoEGPT, SyntheticTokens


@pytest.mark.parametrize(
    "callback",
    [SelectiveRecompute(modules=["mlp", "core_attn"]), SelectiveRecompute(granularity="full"),
     ActivationOffload(modules=["core_attn", "attn_proj"])],
    ids=repr,
)  # fmt: skip
def test_the_callback_logs_what_it_attached(callback, caplog: pytest.LogCaptureFixture) -> None:
    model = MoEGPT(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, num_experts=4, ffn_hidden_size=16)
    attached: list[int] = []
    model.on_train_start = lambda: attached.append(len(callback._handles))
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
    )  # fmt: skip
    with caplog.at_level(logging.INFO):
        trainer.fit(model, datamodule=SyntheticTokens(vocab_size=32, seq_len=8, batch_size=2, num_samples=4))
    assert attached and attached[0] > 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(repr(callback))]
    assert lines == [f"{callback!r}: {attached[0]} regions attached to the model."], lines
