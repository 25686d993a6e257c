"""The fused cross-entropy under ``MoEOverlapStrategy`` on 2 gloo ranks, fused vs unfused (the oracle: the same run
with the logits and ``F.cross_entropy`` / HF's ``loss_function``), SGD for two steps:

- ``pp=2`` (1F1B, two micro-batches): the last stage returns the final norm's output and the loss applies the head
  it holds (``MoEGPT`` and HF Qwen3-MoE);
- ``pp=1, ep=2, shard="full"`` with the overlap on (two micro-batches on two threads): the loss reads the head's
  weight as FSDP has gathered it for the step.

Fused, the head module never runs on the hidden states (a forward hook counts its calls; the unfused runs call it
on the rank holding it).

Each rank's parameters after the steps, and the losses Lightning got, within bounds derived from float32 arithmetic
(``tests/helpers/tolerance.py``), not fitted to one machine's kernels (ATen's order their sums per CPU:
``ATEN_CPU_CAPABILITY``): the losses within :func:`cross_entropy_tols`' loss bounds, and the parameters within the
SGD drift (:func:`sgd_drift`) of gradients within its ``grad_rel`` of their largest entry, step by step, the
unfused run's gradients and parameters (recorded before each step, largest over the ranks) the scale.
"""

from __future__ import annotations

import pytest

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo import MoEGPT, SyntheticTokens
from lightning_moe_overlap.demo_hf import HFMoECausalLM
from lightning_moe_overlap.parallel.dtensors import local
from tests.helpers.distributed import run_distributed
from tests.helpers.tolerance import blocks_of, cross_entropy_tols, logit_terms, sgd_drift

pytestmark = pytest.mark.long  # a variant matrix: `pytest -m long` (docs/benchmarks.md, Tests)

STEPS, LR, CHUNK = 2, 0.5, 19
MODEL = dict(vocab_size=48, hidden_size=16, num_layers=2, num_heads=2, num_experts=4, top_k=2, ffn_hidden_size=8)
DATA = dict(vocab_size=48, seq_len=6, batch_size=4, num_samples=32)
POSITIONS = DATA["batch_size"] * (DATA["seq_len"] + 1)  # at most this many tokens in a loss (a step's batch)
RUNS = {  # name: (model, strategy arguments)
    "gpt-pp2": ("gpt", dict(pp=2, pipeline_schedule="1f1b", num_microbatches=2)),
    "hf-pp2": ("qwen3_moe", dict(pp=2, pipeline_schedule="1f1b", num_microbatches=2)),
    "gpt-shard-full": ("gpt", dict(ep=2, shard="full", overlap=True, num_microbatches=2)),
}


class SGDGPT(MoEGPT):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


class SGDQwen3(HFMoECausalLM):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


class Record(Callback):
    """The losses Lightning got; before each optimizer step, each parameter's and its gradient's largest entry on this
    rank (the scale of the bounds)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.maxima: list[dict[str, tuple[float, float]]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.maxima.append({
            n: (local(p).detach().abs().max().item(), local(p.grad).abs().max().item())
            for n, p in pl_module.named_parameters() if p.grad is not None and local(p.grad).numel()
        })  # fmt: skip


def fit(kind: str, strategy_args: dict, fused: bool) -> dict:
    seed_everything(0)
    if kind == "gpt":
        model = SGDGPT(**MODEL, fused_cross_entropy=fused, cross_entropy_chunk_size=CHUNK)
    else:
        model = SGDQwen3("qwen3_moe", config_overrides={"vocab_size": 48}, fused_cross_entropy=fused,
                         cross_entropy_chunk_size=CHUNK)
    record = Record()
    head = model.head if kind == "gpt" else model.model.lm_head
    head_calls: list[int] = []  # the head module runs only where the logits are built
    terms: list[float] = [0.0]  # the largest sum_d |h_d w_vd| of a logit (where the head runs: unfused)

    def on_head(module, args, out) -> None:
        head_calls.append(out.shape[-2])
        terms.append(logit_terms(local(args[0]), local(module.weight), module.bias))

    head.register_forward_hook(on_head)
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=MoEOverlapStrategy(timeout=120, **strategy_args), max_steps=STEPS,
        limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[record],
    )  # fmt: skip
    trainer.fit(model, datamodule=SyntheticTokens(**DATA))
    params = {n: local(p).detach().clone() for n, p in model.named_parameters() if not p.is_meta}
    return {
        "params": params, "losses": record.losses, "maxima": record.maxima, "head_calls": head_calls,
        "terms": max(terms), "head": (head.out_features, head.in_features),
    }


def worker(rank: int, world_size: int) -> dict:
    torch.use_deterministic_algorithms(True)
    return {name: {fused: fit(kind, args, fused) for fused in (True, False)} for name, (kind, args) in RUNS.items()}


def _bounds(results: list[dict], name: str) -> tuple[dict[str, float], dict[str, float]]:
    """The loss and gradient bounds of run ``name`` (:func:`cross_entropy_tols`), and each parameter's SGD drift
    bound over the steps: the unfused run's maxima, largest over the ranks (a parameter's shards, or the ranks that
    hold it)."""
    plain = [runs[name][False] for runs in results]
    vocab, width = plain[0]["head"]
    tols = cross_entropy_tols(vocab, width, POSITIONS, max(r["terms"] for r in plain), blocks_of(vocab, CHUNK))
    drift: dict[str, float] = {}
    for step in range(STEPS):
        for param in {p for r in plain for p in r["maxima"][step]}:
            p_max, g_max = (
                max(r["maxima"][step][param][i] for r in plain if param in r["maxima"][step]) for i in (0, 1)
            )
            drift[param] = drift.get(param, 0.0) + sgd_drift(LR, tols["grad_rel"] * g_max, p_max, g_max)
    return tols, drift


def test_fused_equals_unfused_under_the_strategy() -> None:
    results = run_distributed(worker, 2, timeout_s=240)
    bounds = {name: _bounds(results, name) for name in RUNS}
    for rank, runs in enumerate(results):
        for name, by_fused in runs.items():
            fused, plain = by_fused[True], by_fused[False]
            tols, drift = bounds[name]
            assert len(fused["losses"]) == STEPS
            assert fused["head_calls"] in ([], [0] * len(fused["head_calls"])), (rank, name)  # HF: no positions
            holds_head = name == "gpt-shard-full" or rank == 1  # the last stage (or every rank at pp=1)
            assert bool(plain["head_calls"]) == holds_head and 0 not in plain["head_calls"], (rank, name)
            torch.testing.assert_close(
                torch.tensor(fused["losses"]), torch.tensor(plain["losses"]), rtol=tols["loss_rtol"],
                atol=tols["loss_atol"],
            )
            assert fused["params"].keys() == plain["params"].keys() and fused["params"], (rank, name)
            for param, want in plain["params"].items():
                torch.testing.assert_close(
                    fused["params"][param], want, rtol=0, atol=drift[param], msg=lambda m: f"{rank} {name} {m}"
                )
