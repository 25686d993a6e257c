"""HF transformers v5 MoE models under MoEOverlapStrategy(ep=2) on 2 gloo ranks (dp=2).

Oracles: the loss curve and the global gradient norm follow single-process training on the same global batches;
with the overlap on, the parameters are bitwise equal to the sequential schedule (user ``training_step`` unchanged).
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo_hf import HFMoECausalLM
from lightning_moe_overlap.parallel.dtensors import local
from tests.helpers.data import RandomTokens
from tests.helpers.distributed import run_distributed

WORLD, STEPS, BATCH, MICRO, CLIP = 2, 3, 4, 2, 0.5


class Tokens(RandomTokens):
    def __init__(self, n: int = 32, seq: int = 8, vocab: int = 128) -> None:
        super().__init__(n, seq, vocab, seed=7, indexed=True)


class Recorder(HFMoECausalLM):
    """The user's module, unchanged, plus records of what each rank saw (not part of the computation)."""

    def __init__(self, model_type: str) -> None:
        super().__init__(model_type=model_type, lr=1e-2)
        self.seen, self.norms = [], []

    def training_step(self, batch, batch_idx):
        tokens, idx = batch
        self.seen.extend(idx.tolist())
        return super().training_step(tokens, batch_idx)

    def on_before_optimizer_step(self, optimizer):
        self.norms.append(float(self.trainer.strategy.global_grad_norm()))

    def train_dataloader(self):
        return DataLoader(Tokens(), batch_size=BATCH)


def _fit(model_type: str, **strategy_kwargs) -> dict:
    model = Recorder(model_type)
    losses: list[float] = []
    trainer = Trainer(
        accelerator="cpu", devices=WORLD, max_steps=STEPS, gradient_clip_val=CLIP, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        strategy=MoEOverlapStrategy(ep=2, num_microbatches=MICRO, **strategy_kwargs),
    )
    model.on_train_batch_end = lambda outputs, *_: losses.append(float(outputs["loss"]))
    trainer.fit(model)
    experts = sum(local(p).numel() for n, p in model.named_parameters() if ".experts." in n)
    return {
        "losses": losses, "seen": model.seen, "norms": model.norms, "expert_numel": experts,
        "params": [local(p).detach().clone() for p in model.parameters()],
    }


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    return {
        "qwen3": _fit("qwen3_moe", overlap=True, delay_wgrad=True),
        "qwen3_seq": _fit("qwen3_moe", overlap=False),
        "qwen3_overlap": _fit("qwen3_moe", overlap=True),
        "mixtral": _fit("mixtral", overlap=True),
    }


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_worker, WORLD, timeout_s=120)


def _reference(model_type: str, seen_per_rank: list[list[int]]) -> tuple[list[float], list[float], int]:
    """Single process, full experts: each step's loss is the mean over ranks and micro-batches, as the strategy's."""
    model = HFMoECausalLM(model_type=model_type, lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = Tokens().data
    size = BATCH // MICRO
    losses, norms = [], []
    for step in range(STEPS):
        parts = [
            seen[step * BATCH + m * size : step * BATCH + (m + 1) * size] for seen in seen_per_rank for m in range(MICRO)
        ]
        opt.zero_grad()
        loss = torch.stack([model.model(input_ids=data[p], labels=data[p]).loss for p in parts]).mean()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        losses.append(float(loss.detach()))
        opt.step()
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return losses, norms, experts


@pytest.mark.parametrize("key,model_type", [("qwen3", "qwen3_moe"), ("mixtral", "mixtral")])
def test_hf_model_follows_single_process_loss_curve_and_grad_norm(results, key, model_type):
    runs = [r[key] for r in results]
    ref_losses, ref_norms, ref_expert_numel = _reference(model_type, [run["seen"] for run in runs])
    dist_losses = [sum(run["losses"][s] for run in runs) / WORLD for s in range(STEPS)]
    torch.testing.assert_close(torch.tensor(dist_losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    for run in runs:  # the norm is global: identical on every rank, and equal to the unsharded model's
        torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(ref_norms), rtol=1e-4, atol=0)
        assert run["expert_numel"] * 2 == ref_expert_numel  # each rank holds half of the experts (ep=2)
    assert len(set(ref_losses)) == STEPS  # the steps change the model (the comparison is not of constants)


def test_hf_overlap_is_bitwise_equal_to_sequential(results):
    for rank_result in results:
        reference = rank_result["qwen3_seq"]["params"]
        for key in ("qwen3_overlap", "qwen3"):  # overlap, and overlap with delayed wgrad
            for a, b in zip(rank_result[key]["params"], reference):
                assert torch.equal(a, b), key
