"""Tensor and sequence parallelism under MoEOverlapStrategy(tp=2, ep=2) on 4 gloo ranks (dp=2; ep folds over tp).

Oracles: a single process training the unsplit model on the same global batches (HF Qwen3-MoE: HF's own forward;
``MoEGPT``: the module's own loss, aux loss and shared expert included), the per-rank bytes of the parameters, and at
tp=2 the overlapped schedule bitwise equal to the sequential one. A checkpoint written at tp=2 loads at tp=1.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.demo_hf import HFMoECausalLM
from lightning_moe_overlap.moe.router import TopKRouter
from lightning_moe_overlap.parallel.dtensors import local
from tests.helpers.data import RandomTokens
from tests.helpers.distributed import run_distributed

WORLD, TP, STEPS, BATCH, MICRO, SEQ = 4, 2, 3, 4, 2, 9
GPT_CONFIG = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_experts=4, top_k=2, ffn_hidden_size=16,
           shared_expert_ffn_hidden_size=16, aux_loss_coeff=1e-2, lr=1e-2)  # fmt: skip


class Tokens(RandomTokens):
    def __init__(self, n: int = 64, seq: int = SEQ, vocab: int = 64) -> None:
        super().__init__(n, seq, vocab, seed=7, indexed=True)


class _Seen:
    """Records what each rank trained on (not part of the computation)."""

    seq = SEQ

    def training_step(self, batch, batch_idx):
        tokens, idx = batch
        self.seen.extend(idx.tolist())
        return super().training_step(tokens, batch_idx)

    def train_dataloader(self):
        return DataLoader(Tokens(seq=self.seq), batch_size=BATCH)


class GPT(_Seen, MoEGPT):
    def __init__(self) -> None:
        super().__init__(**GPT_CONFIG, seed=3)
        self.seen: list[int] = []


class Qwen(_Seen, HFMoECausalLM):
    seq = SEQ - 1  # HF's loss shifts inside: the model sees the whole sequence

    def __init__(self) -> None:
        super().__init__(model_type="qwen3_moe", lr=1e-2)
        self.seen = []


def _fit(cls, tmp: str | None = None, resume: str | None = None, **kwargs) -> dict:
    torch.manual_seed(0 if resume is None else 1)  # a resumed model starts from other values than the saved one
    model = cls()
    losses: list[float] = []
    trainer = Trainer(
        accelerator="cpu", devices=WORLD, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        strategy=MoEOverlapStrategy(num_microbatches=MICRO, **{"tp": TP, "ep": 2, **kwargs}),
    )
    model.on_train_batch_end = lambda outputs, *_: losses.append(float(outputs["loss"]))
    trainer.fit(model, ckpt_path=resume)  # resumed at its last step: restores, runs no step
    if tmp is not None:
        trainer.save_checkpoint(tmp)
    state = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
             for n, p in model.named_parameters()}  # fmt: skip
    held = sum(local(p).numel() * local(p).element_size() for p in model.parameters())
    return {"losses": losses, "seen": model.seen, "state": state, "held_bytes": held}


def _worker(rank: int, world: int, tmp: str) -> dict:
    torch.set_num_threads(1)
    return {
        "gpt": _fit(GPT, overlap=False),
        "gpt_overlap": _fit(GPT, overlap=True),
        "gpt_tp1": _fit(GPT, tp=1, overlap=False),
        "qwen": _fit(Qwen, tmp=f"{tmp}/qwen.ckpt", overlap=True),
        "qwen_at_tp1": _fit(Qwen, resume=f"{tmp}/qwen.ckpt", tp=1),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_distributed(_worker, WORLD, str(tmp_path_factory.mktemp("tp")), timeout_s=300)


def _reference(model, loss_of, seen_per_dp: list[list[int]], seq: int) -> list[float]:
    """One process, the unsplit model: each step's loss is the mean over dp ranks and micro-batches."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = Tokens(seq=seq).data
    size = BATCH // MICRO
    for router in (m for m in model.modules() if isinstance(m, TopKRouter)):  # the step's loss is a mean of parts
        router.aux_loss_scale = 1.0 / (len(seen_per_dp) * MICRO)
    losses = []
    for step in range(STEPS):
        parts = [seen[step * BATCH + m * size: step * BATCH + (m + 1) * size] for seen in seen_per_dp for m in range(MICRO)]
        opt.zero_grad()
        loss = torch.stack([loss_of(model, data[p]) for p in parts]).mean()
        loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
    return losses


def _dp_seen(runs: list[dict]) -> list[list[int]]:
    return [runs[r]["seen"] for r in range(0, WORLD, TP)]  # tp peers train on the same samples


def test_moegpt_at_tp2_follows_one_process(results):
    runs = [r["gpt"] for r in results]
    assert runs[0]["seen"] == runs[1]["seen"] and runs[0]["seen"] != runs[2]["seen"]

    def loss_of(model, tokens):
        logits = model(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    torch.manual_seed(0)
    model = MoEGPT(**GPT_CONFIG, seed=3)
    ref = _reference(model, loss_of, _dp_seen(runs), GPT.seq)
    dist_losses = [sum(run["losses"][s] for run in runs[::TP]) / (WORLD // TP) for s in range(STEPS)]
    torch.testing.assert_close(torch.tensor(dist_losses), torch.tensor(ref), rtol=1e-4, atol=0)
    for name, value in model.state_dict().items():
        if name in runs[0]["state"]:
            torch.testing.assert_close(runs[0]["state"][name], value, rtol=1e-4, atol=1e-4, msg=name)


def test_qwen3_at_tp2_follows_hf_in_one_process(results):
    runs = [r["qwen"] for r in results]
    torch.manual_seed(0)
    model = HFMoECausalLM(model_type="qwen3_moe", lr=1e-2)
    ref = _reference(model, lambda m, t: m.model(input_ids=t, labels=t).loss, _dp_seen(runs), Qwen.seq)
    dist_losses = [sum(run["losses"][s] for run in runs[::TP]) / (WORLD // TP) for s in range(STEPS)]
    torch.testing.assert_close(torch.tensor(dist_losses), torch.tensor(ref), rtol=1e-4, atol=0)


def test_overlap_at_tp2_is_bitwise_equal_to_sequential(results):
    for r in results:
        for name, value in r["gpt"]["state"].items():
            assert torch.equal(r["gpt_overlap"]["state"][name], value), name


def test_a_tp2_checkpoint_resumes_at_tp1_bitwise(results):
    for r in results:
        assert r["qwen_at_tp1"]["losses"] == []  # resumed at its last step
        for name, value in r["qwen"]["state"].items():
            assert torch.equal(r["qwen_at_tp1"]["state"][name], value), name


def test_tp2_holds_half_of_the_attention_and_embeddings(results):
    """Per-rank parameter bytes, counted on the unsplit model: the planned tensors (attention projections,
    embedding, LM head) halve at tp=2, the experts are split over ep=2, the rest is whole."""
    model = HFMoECausalLM(model_type="qwen3_moe", lr=1e-2)
    planned = ("q_proj", "k_proj", "v_proj", "o_proj", "embed_tokens", "lm_head")
    expected = 0
    for name, p in model.named_parameters():
        share = TP if any(f".{k}." in f".{name}" for k in planned) else 2 if ".experts." in name else 1
        expected += p.numel() * p.element_size() // share
    for r in results:
        assert r["qwen"]["held_bytes"] == expected
        assert r["qwen_at_tp1"]["held_bytes"] > expected  # the same model at tp=1 holds the planned tensors whole
