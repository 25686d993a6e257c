"""``HFMoECausalLM`` (HF Qwen3-MoE) under MoEOverlapStrategy(cp=2, ep=2): on 2 gloo ranks (dp=1), on 4 with
tensor parallelism (cp=2 x tp=2, dp=1: the attention's heads split over tp inside the ring, HF's own balancing loss
from the sequence-parallel router logits), and on 4 (dp=2; ep folds over dp x cp) under the ``long`` marker.

Oracles: a single process training the unsplit HF model on the same global batches, whole sequences, with HF's own
``model(input_ids, labels).loss`` (its shift, its mean, its router balancing loss); at cp=2 the overlapped schedule
bitwise equal to the sequential one; a padded attention_mask refused at the first step.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo_hf import HFMoECausalLM
from tests.helpers.data import RandomTokens
from tests.helpers.distributed import run_distributed, run_distributed_expect_errors

CP, STEPS, BATCH, MICRO, SEQ, LR = 2, 3, 4, 2, 16, 1e-2  # 16 tokens: 2 x cp = 4 chunks of 4
AUX = dict(output_router_logits=True, router_aux_loss_coef=0.1)  # a coefficient large enough to move the weights


class Tokens(RandomTokens):
    def __init__(self, n: int = 32, seq: int = SEQ, vocab: int = 128) -> None:
        super().__init__(n, seq, vocab, seed=7, indexed=True)


class Recorder(HFMoECausalLM):
    """The user's module, unchanged, plus a record of the samples each rank trained on."""

    def __init__(self, config_overrides: dict, fused: bool) -> None:
        super().__init__("qwen3_moe", lr=LR, config_overrides=config_overrides, fused_cross_entropy=fused,
                         cross_entropy_chunk_size=32)  # fmt: skip
        self.seen: list[int] = []

    def training_step(self, batch, batch_idx):
        tokens, idx = batch
        self.seen.extend(idx.tolist())
        return super().training_step(tokens, batch_idx)

    def train_dataloader(self):
        return DataLoader(Tokens(), batch_size=BATCH)


def _fit(world: int, config_overrides: dict | None = None, fused: bool = False, **strategy_kwargs) -> dict:
    model = Recorder(config_overrides or {}, fused)
    losses: list[float] = []
    trainer = Trainer(
        accelerator="cpu", devices=world, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        strategy=MoEOverlapStrategy(num_microbatches=MICRO, **{"cp": CP, "ep": 2, **strategy_kwargs}),
    )
    model.on_train_batch_end = lambda outputs, *_: losses.append(float(outputs["loss"]))
    trainer.fit(model)
    state = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
             for n, p in model.named_parameters()}  # fmt: skip
    return {"losses": losses, "seen": model.seen, "state": state}


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    return {
        "plain": _fit(world, overlap=False),
        "plain_overlap": _fit(world, overlap=True),
        "aux": _fit(world, AUX, overlap=False),
        "aux_fused": _fit(world, AUX, fused=True, overlap=True),
    }


@pytest.fixture(scope="module")
def results2() -> list[dict]:
    return run_distributed(_worker, 2, timeout_s=300)


def _worker_tp(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    return {
        "plain": _fit(world, overlap=False, tp=2),
        "plain_overlap": _fit(world, overlap=True, tp=2),
        "aux": _fit(world, AUX, overlap=True, tp=2),
        "aux_fused": _fit(world, AUX, fused=True, overlap=True, tp=2),  # the vocabulary-parallel head's rows
    }


@pytest.fixture(scope="module")
def results_tp() -> list[dict]:
    return run_distributed(_worker_tp, 4, timeout_s=300)


@pytest.fixture(scope="module")
def results4() -> list[dict]:
    return run_distributed(_worker, 4, timeout_s=300)


def _reference(config_overrides: dict, seen_per_dp: list[list[int]]) -> tuple[list[float], dict]:
    """One process, the unsplit HF model on whole sequences with its own loss: each step's loss is the mean over dp
    ranks and micro-batches."""
    model = HFMoECausalLM("qwen3_moe", lr=LR, config_overrides=config_overrides).model
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    data = Tokens().data
    size = BATCH // MICRO
    losses = []
    for step in range(STEPS):
        first = step * BATCH
        parts = [seen[first + m * size : first + (m + 1) * size] for seen in seen_per_dp for m in range(MICRO)]
        opt.zero_grad()
        loss = torch.stack([model(input_ids=data[p], labels=data[p]).loss for p in parts]).mean()
        loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
    return losses, {f"model.{n}": p.detach() for n, p in model.named_parameters()}


def _check_follows_one_process(runs: list[dict], config_overrides: dict, peers: int = CP) -> tuple[float, float]:
    """Per-step loss (the mean over the ranks' shares) and final parameters within 1e-4; returns the largest
    relative loss difference and the largest parameter difference. ``peers``: the ranks of one dp index (cp x tp)."""
    dp_ranks = runs[::peers]  # ranks peers * d to peers * (d + 1) - 1 hold the parts of dp rank d's sequences
    for d, run in enumerate(dp_ranks):  # cp (and tp) peers share samples, dp ranks do not
        assert all(peer["seen"] == run["seen"] for peer in runs[d * peers : (d + 1) * peers])
    ref_losses, ref_state = _reference(config_overrides, [run["seen"] for run in dp_ranks])
    dist_losses = [sum(run["losses"][s] for run in runs) / len(runs) for s in range(STEPS)]
    torch.testing.assert_close(torch.tensor(dist_losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    assert len(set(ref_losses)) == STEPS  # the steps change the model (the comparison is not of constants)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(dist_losses, ref_losses))
    worst = 0.0
    for name, value in ref_state.items():
        got = runs[0]["state"][name]
        torch.testing.assert_close(got, value, rtol=1e-4, atol=1e-4, msg=name)
        worst = max(worst, float((got - value).abs().max()))
    return loss_err, worst


def _follows(results: list[dict], key: str, overrides: dict) -> None:
    loss_err, worst = _check_follows_one_process([r[key] for r in results], overrides)
    print(f"{len(results)} ranks, {key}: loss rel. diff {loss_err:.1e}, largest parameter diff {worst:.1e}")


def _bitwise(results: list[dict]) -> None:
    for r in results:
        assert r["plain_overlap"]["losses"] == r["plain"]["losses"]
        for name, value in r["plain"]["state"].items():
            assert torch.equal(r["plain_overlap"]["state"][name], value), name


CASES = [("plain", {}), ("aux", AUX), ("aux_fused", AUX)]


@pytest.mark.parametrize("key,overrides", CASES)
def test_hf_qwen3_moe_at_cp2_follows_one_process(results2, key, overrides):
    _follows(results2, key, overrides)


def test_hf_overlap_at_cp2_is_bitwise_equal_to_sequential(results2):
    _bitwise(results2)


@pytest.mark.long
@pytest.mark.parametrize("key,overrides", CASES)
def test_hf_qwen3_moe_at_cp2_dp2_follows_one_process(results4, key, overrides):
    _follows(results4, key, overrides)


@pytest.mark.long
def test_hf_overlap_at_cp2_dp2_is_bitwise_equal_to_sequential(results4):
    _bitwise(results4)


class Padded(HFMoECausalLM):
    def train_dataloader(self):
        data = Tokens(n=8).data
        mask = torch.ones_like(data)
        mask[:, -3:] = 0  # right padding
        return DataLoader([{"input_ids": i, "attention_mask": m} for i, m in zip(data, mask)], batch_size=BATCH)


def _padded(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    trainer = Trainer(
        accelerator="cpu", devices=world, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        strategy=MoEOverlapStrategy(num_microbatches=MICRO, cp=2, ep=2),
    )
    trainer.fit(Padded("qwen3_moe"))


def test_a_padded_attention_mask_is_refused_at_cp2():
    errors = run_distributed_expect_errors(_padded, 2, timeout_s=120)
    assert errors, "the run did not fail"
    for rank, text in errors.items():
        assert "rule `cp-hf-batch`" in text and "cp=2: the batch's attention_mask [2, 16] marks 6 padding" in text, text


def test_hf_qwen3_moe_at_cp2_tp2_follows_one_process_and_overlap_is_bitwise(results_tp):
    loss_err, worst = _check_follows_one_process([r["plain"] for r in results_tp], {}, peers=4)
    print(f"cp=2 x tp=2: loss rel. diff {loss_err:.1e}, largest parameter diff {worst:.1e}")
    _bitwise(results_tp)


def test_hf_balancing_loss_at_cp2_tp2_follows_one_process(results_tp):
    """HF's own balancing loss at cp x tp: each rank's router logits are its sequence-parallel rows; the tp ranks of a
    cp rank report the same loss (its share), and the run follows HF's ``model(...).loss`` with the loss on, with the
    logits and with the fused cross-entropy over the vocabulary-parallel head."""
    for key in ("aux", "aux_fused"):
        loss_err, worst = _check_follows_one_process([r[key] for r in results_tp], AUX, peers=4)
        print(f"cp=2 x tp=2, {key}: loss rel. diff {loss_err:.1e}, largest parameter diff {worst:.1e}")
        for cp_rank in range(CP):  # ranks (cp, tp): cp-major, tp innermost
            peers = [results_tp[cp_rank * 2 + t][key]["losses"] for t in range(2)]
            assert peers[0] == peers[1], (key, cp_rank, peers)
