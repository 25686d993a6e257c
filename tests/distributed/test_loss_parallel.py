"""The LM head's loss at tp=2 under MoEOverlapStrategy(tp=2, ep=2) on 2 gloo ranks (one tp pair, also the ep group),
overlapped: the logits stay vocabulary-sharded (torch's ``loss_parallel``, entered by the strategy) or never exist
(the fused cross-entropy over the head's rows), for MoEGPT and HF Qwen3-MoE.

Oracle: one process training the unsplit model with plain SGD on the same micro-batches, its loss from the whole
logits (``F.cross_entropy`` / HF's own ``loss``): per-step losses and the parameters after every step within 1e-5.
A user's ``training_step`` that computes its loss from ``outputs.logits`` (a vocabulary-sharded ``DTensor`` at
tp > 1) trains the same way, its returned loss made plain by the strategy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.demo_hf import HFMoECausalLM
from lightning_moe_overlap.moe.router import TopKRouter
from tests.helpers.data import RandomTokens
from tests.helpers.distributed import run_distributed

STEPS, BATCH, MICRO, LR = 3, 4, 2, 0.1
GPT_CONFIG = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_experts=4, top_k=2, ffn_hidden_size=16,
                  shared_expert_ffn_hidden_size=16, aux_loss_coeff=1e-2)  # fmt: skip
SEQ = {"gpt": 9, "qwen": 8}  # MoEGPT shifts outside its forward, HF inside: 8 positions either way


class Tokens(RandomTokens):
    def __init__(self, seq: int, vocab: int = 64) -> None:
        super().__init__(64, seq, vocab, seed=7, indexed=True)


class _SGD:
    """Plain SGD (the oracle's parameters follow the gradients linearly); records the samples each step trained on
    (the strategy's sampler shuffles), not part of the computation."""

    seq = 0

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        return DataLoader(Tokens(self.seq), batch_size=BATCH)

    def training_step(self, batch, batch_idx):
        tokens, idx = batch
        self.seen.extend(idx.tolist())
        return self.step_loss(tokens, batch_idx)

    def step_loss(self, tokens, batch_idx):
        return super().training_step(tokens, batch_idx)


class GPT(_SGD, MoEGPT):
    seq = SEQ["gpt"]

    def __init__(self, fused: bool = False) -> None:
        super().__init__(**GPT_CONFIG, seed=3, fused_cross_entropy=fused)
        self.seen: list[int] = []


class Qwen(_SGD, HFMoECausalLM):
    seq = SEQ["qwen"]

    def __init__(self, fused: bool = False) -> None:
        super().__init__(model_type="qwen3_moe", seed=3, fused_cross_entropy=fused)
        self.seen: list[int] = []


class QwenAux(Qwen):
    """HF's own router auxiliary loss on (``output_router_logits``): added after the loss-parallel cross-entropy."""

    def __init__(self, fused: bool = False) -> None:
        HFMoECausalLM.__init__(self, model_type="qwen3_moe", seed=3, fused_cross_entropy=fused,
                               config_overrides={"output_router_logits": True, "router_aux_loss_coef": 0.1})
        self.seen = []


class QwenFromLogits(Qwen):
    """A user's step: the loss from ``outputs.logits`` (``[B, S, V]`` global shape, ``V / tp`` columns here)."""

    def __init__(self, fused: bool = False) -> None:
        super().__init__(fused)
        self.logits_types: list[tuple[str, tuple[int, ...]]] = []

    def step_loss(self, batch, batch_idx):
        logits_BSV = self.model(input_ids=batch).logits
        self.logits_types.append((type(logits_BSV).__name__, tuple(logits_BSV.shape)))
        flat = logits_BSV[:, :-1].reshape(-1, logits_BSV.shape[-1]).float()
        return F.cross_entropy(flat, batch[:, 1:].reshape(-1))


def _fit(cls, fused: bool = False) -> dict:
    torch.manual_seed(0)  # the strategy's initialisation draws from the global seed, as the oracle's does
    model = cls(fused)
    losses: list[float] = []
    trainer = Trainer(
        accelerator="cpu", devices=2, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        strategy=MoEOverlapStrategy(tp=2, ep=2, num_microbatches=MICRO, overlap=True),
    )
    model.on_train_batch_end = lambda outputs, *_: losses.append(outputs["loss"])
    trainer.fit(model)
    state = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
             for n, p in model.named_parameters()}  # fmt: skip
    return {"losses": [float(x) for x in losses], "plain": all(type(x) is torch.Tensor for x in losses),
            "state": state, "logits": list(getattr(model, "logits_types", [])), "seen": model.seen}  # fmt: skip


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    return {
        "gpt": _fit(GPT), "gpt_fused": _fit(GPT, fused=True), "qwen": _fit(Qwen), "qwen_fused": _fit(Qwen, fused=True),
        "qwen_user": _fit(QwenFromLogits), "qwen_aux": _fit(QwenAux), "qwen_aux_fused": _fit(QwenAux, fused=True),
    }


def _reference(kind: str, seen: list[int]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the unsplit model, SGD on the samples the run saw: each step's loss is the mean over its
    micro-batches."""
    torch.manual_seed(0)
    model = GPT() if kind == "gpt" else Qwen()
    if kind == "gpt":
        loss_of = lambda m, t: F.cross_entropy(m(t[:, :-1]).flatten(0, 1), t[:, 1:].flatten())  # noqa: E731
    else:
        loss_of = lambda m, t: m.model(input_ids=t, labels=t).loss  # noqa: E731
    for router in (m for m in model.modules() if isinstance(m, TopKRouter)):
        router.aux_loss_scale = 1.0 / MICRO
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data, size, losses = Tokens(SEQ[kind]).data, BATCH // MICRO, []
    for step in range(STEPS):
        opt.zero_grad()
        parts = [data[seen[step * BATCH + m * size: step * BATCH + (m + 1) * size]] for m in range(MICRO)]
        loss = torch.stack([loss_of(model, p) for p in parts]).mean()
        loss.backward()
        losses.append(float(loss))
        opt.step()
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def test_tp2_loss_follows_the_unsplit_model_unfused_fused_and_from_user_logits():
    results = run_distributed(_worker, 2, timeout_s=400)
    for run in ("gpt", "gpt_fused", "qwen", "qwen_fused", "qwen_user"):
        assert results[0][run]["seen"] == results[1][run]["seen"]  # tp peers train on the same samples
        ref_losses, ref_state = _reference(run.split("_")[0], results[0][run]["seen"])
        for r in results:
            got = r[run]
            assert got["plain"], run  # Lightning received plain losses
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses), rtol=0, atol=1e-5,
                                       msg=f"{run}: {got['losses']} vs {ref_losses}")  # fmt: skip
            for name, value in ref_state.items():
                torch.testing.assert_close(got["state"][name], value, rtol=0, atol=1e-5, msg=f"{run}: {name}")
    for r in results:  # HF's auxiliary loss at tp > 1 (a sum of the shards' losses): unfused as fused, both trained
        assert r["qwen_aux"]["plain"] and len(r["qwen_aux"]["losses"]) == STEPS
        torch.testing.assert_close(torch.tensor(r["qwen_aux"]["losses"]), torch.tensor(r["qwen_aux_fused"]["losses"]),
                                   rtol=1e-5, atol=0)  # fmt: skip
        assert r["qwen_aux"]["losses"] != r["qwen"]["losses"]  # the auxiliary loss was added
    for r in results:  # the user's logits: a DTensor of the whole shape, sharded by vocabulary
        assert r["qwen_user"]["logits"] and all(t == ("DTensor", (2, 8, 128)) for t in r["qwen_user"]["logits"])
