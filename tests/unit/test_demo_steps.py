"""The demo model tests and predicts: ``test_loss`` and the predicted tokens against a hand-written evaluation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer

from lightning_moe_overlap.demo import MoEGPT, SyntheticTokens
from tests.helpers.tolerance import reordered_sum_tol

V, S, B = 64, 8, 4


def _setup() -> tuple[MoEGPT, SyntheticTokens, Trainer]:
    torch.manual_seed(0)
    model = MoEGPT(vocab_size=V, hidden_size=16, num_layers=1, num_heads=2, num_experts=4, top_k=2, ffn_hidden_size=16)
    data = SyntheticTokens(vocab_size=V, seq_len=S, batch_size=B, num_samples=16)
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_test_batches=2, limit_predict_batches=2)
    return model, data, trainer


def test_test_logs_the_mean_next_token_loss() -> None:
    model, data, trainer = _setup()
    (metrics,) = trainer.test(model, datamodule=data, verbose=False)
    batches = [b for _, b in zip(range(2), data.test_dataloader())]
    with torch.no_grad():
        losses = []
        for tokens in batches:  # the loss by hand: every position predicts the next token
            logits = model(tokens[:, :-1])
            losses.append(F.cross_entropy(logits.reshape(-1, V), tokens[:, 1:].reshape(-1)))
    _assert_mean_of(metrics["test_loss"], losses)


def _assert_mean_of(logged: float, losses: list) -> None:
    """``logged`` is the mean of the per-batch ``losses`` (the same computation batch by batch) as Lightning averages
    them: each weighted by its batch size, summed, divided; the reference sums and divides. Both in float32, of
    positive terms: within ``reordered_sum_tol(2 * batches + 1)`` of the mean (tests/helpers/tolerance.py)."""
    mean = torch.stack(losses).mean().item()
    assert abs(logged - mean) <= reordered_sum_tol(2 * len(losses) + 1, mean), (logged, mean)


def test_predict_returns_the_most_likely_next_tokens() -> None:
    model, data, trainer = _setup()
    predicted = trainer.predict(model, datamodule=data)
    assert len(predicted) == 2
    tokens = next(iter(data.predict_dataloader()))
    with torch.no_grad():
        expected = model(tokens).argmax(dim=-1)
    assert predicted[0].shape == (B, S + 1)
    assert torch.equal(predicted[0], expected)


def test_hf_demo_tests_and_predicts() -> None:
    pytest.importorskip("transformers")
    from torch.utils.data import DataLoader

    from lightning_moe_overlap.demo_hf import HFMoECausalLM

    model = HFMoECausalLM("qwen3_moe")
    tokens = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(tokens, batch_size=2)
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    (metrics,) = trainer.test(model, dataloaders=loader, verbose=False)
    predicted = trainer.predict(model, dataloaders=loader)
    with torch.no_grad():  # HF's own loss and logits of the same weights
        losses = [model.model(input_ids=b, labels=b).loss for b in tokens.split(2)]
        expected = [model.model(input_ids=b).logits.argmax(dim=-1) for b in tokens.split(2)]
    _assert_mean_of(metrics["test_loss"], losses)
    assert all(torch.equal(p, e) for p, e in zip(predicted, expected))


def test_demo_takes_a_tensor_dataset_loaders_list_batches() -> None:
    model, data, _ = _setup()
    tokens = next(iter(data.test_dataloader()))
    assert torch.equal(model._loss([tokens]), model._loss(tokens))
    with pytest.raises(TypeError, match=r"MoEGPT"):
        model._loss([tokens, tokens])
