"""`start_method="spawn"`: the Trainer in this process spawns the ranks; the trained model comes back whole."""

from __future__ import annotations

import torch
from lightning.pytorch import Trainer

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo import MoEGPT, SyntheticTokens


def test_spawn_launch_returns_every_expert_to_the_main_process():
    torch.manual_seed(0)
    model = MoEGPT(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_experts=4, top_k=2, ffn_hidden_size=32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(
        accelerator="cpu", devices=2, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        strategy=MoEOverlapStrategy(ep=2, num_microbatches=2, start_method="spawn"),
    )
    trainer.fit(model, datamodule=SyntheticTokens(vocab_size=64, seq_len=16, batch_size=8))
    assert trainer.state.finished  # (loop progress stays in the workers, as with `ddp_spawn`)
    after = model.state_dict()
    assert after.keys() == before.keys()
    experts = [k for k in after if ".experts." in k]
    assert experts
    for key in experts:  # full [E, ...] tensors, and every expert (both ranks' halves) was trained
        assert after[key].shape == before[key].shape and after[key].shape[0] == 4
        for e in range(4):
            assert not torch.equal(after[key][e], before[key][e]), (key, e)


def test_spawn_registered_name_resolves_to_spawn():
    trainer = Trainer(accelerator="cpu", devices=2, strategy="moe_overlap_spawn", logger=False)
    assert isinstance(trainer.strategy, MoEOverlapStrategy)
    assert trainer.strategy.config.start_method == "spawn"
