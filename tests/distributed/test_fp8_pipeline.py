"""``MoEOverlapStrategy(fp8=..., pp=2)``: FP8 GEMMs on pipeline chunks, under torch's schedules.

2 gloo ranks (pp=2, ep=1): interleaved 1F1B by default, the other schedules under the ``long`` marker, as is a
4-rank run (pp=2 x ep=2, dp=2: the FP8 dispatch crosses processes). One spawn, several fits on the same processes:
- overlap on vs off under the same schedule in FP8: losses and every parameter ``torch.equal`` on every rank;
- each run against the unsplit model in one process, converted by ``apply_fp8`` with the same recipe, on the same
  global batches (SGD), per step and in every parameter within 1e-5: ``rowwise`` (one scale per row of a GEMM operand,
  wherever the GEMM runs) under interleaved 1F1B, DualPipeV, zero-bubble (split input and weight gradients), 1F1B on a
  model built on the meta device (chunks materialised before the conversion) and HF Qwen3-MoE; ``mxfp8`` (rows
  dispatched in high precision); ``tensorwise`` with the rows dispatched in high precision (its FP8 dispatch scales
  each row, a finer quantisation than the unsplit model's, docs/fp8.md; the rowwise runs check the dispatch, exact
  there), and within 2% of the float32 run;
- FP8 runs where the rank's chunks are: every FP8 linear of a held chunk ran its forward, the same number of times,
  those of the other rank's chunks (on meta) never.

Shapes: B samples per dp rank and step, S tokens, M micro-batches.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo import SyntheticTokens, gpt_init_module
from lightning_moe_overlap.fp8 import apply_fp8
from lightning_moe_overlap.fp8.apply import has_fp8_kernel
from lightning_moe_overlap.moe import apply_expert_parallel
from lightning_moe_overlap.moe.dispatch.loopback import Loopback
from lightning_moe_overlap.moe.ep import ExpertParallelExperts
from lightning_moe_overlap.moe.router import TopKRouter
from lightning_moe_overlap.overlap.runtime import CommRuntime
from lightning_moe_overlap.parallel.dtensors import local
from lightning_moe_overlap.pipeline.split import seeded_init
from tests.helpers.distributed import run_distributed
from tests.helpers.sgd import SGDGPT, SGDQwen3

PP, M, B, S, STEPS, SEED = 2, 4, 4, 6, 3, 0
MODEL = dict(vocab_size=32, hidden_size=16, num_layers=4, num_heads=2, num_experts=4, top_k=2, ffn_hidden_size=16,
             aux_loss_coeff=0.01)  # fmt: skip
RUNS = (  # (name, model, schedule, vpp, overlap, recipe)
    ("interleaved", "gpt", "interleaved_1f1b", 2, True, "tensorwise"),
    ("interleaved-off", "gpt", "interleaved_1f1b", 2, False, "tensorwise"),
    ("hf", "qwen3_moe", "interleaved_1f1b", 2, True, "rowwise"),
    ("mxfp8", "gpt32", "interleaved_1f1b", 2, True, "mxfp8"),  # MXFP8 needs dims that are multiples of 32
)
SCHEDULE_RUNS = (  # the other schedules (``long``)
    ("dualpipev", "gpt", "dualpipev", 2, True, "rowwise"),
    ("1f1b-meta", "gpt-meta", "1f1b", 1, False, "rowwise"),
    ("1f1b-overlap", "gpt-meta", "1f1b", 1, True, "rowwise"),  # its paired order
    ("zero-bubble", "gpt", "zero_bubble", 2, False, "rowwise"),
)
WIDE_RUNS = (  # at pp=2 x ep=2 (``long``)
    ("interleaved", "gpt", "interleaved_1f1b", 2, True, "rowwise"),
    ("interleaved-off", "gpt", "interleaved_1f1b", 2, False, "rowwise"),
    ("dualpipev", "gpt", "dualpipev", 2, True, "rowwise"),
)
PAIRS = (("interleaved", "interleaved-off"),)
RTOL, FP32_RTOL = 1e-5, 2e-2


class MetaGPT(SGDGPT):
    def __init__(self, **kwargs) -> None:  # noqa: ANN003
        with torch.device("meta"):
            super().__init__(**kwargs)


def build(kind: str) -> torch.nn.Module:
    wide = {**MODEL, "hidden_size": 32, "ffn_hidden_size": 32}
    return {"gpt": lambda: SGDGPT(**MODEL), "gpt-meta": lambda: MetaGPT(**MODEL), "qwen3_moe": SGDQwen3,
            "gpt32": lambda: SGDGPT(**wide)}[kind]()  # fmt: skip


class Record(Callback):
    """The batches and losses of each step and the forwards of each FP8 linear (counted from the strategy's setup);
    with ``tensorwise``, the experts' rows dispatched in high precision."""

    def __init__(self, fp8_dispatch: bool) -> None:
        self.fp8_dispatch = fp8_dispatch
        self.forwards: Counter[str] = Counter()
        self.batches: list[torch.Tensor] = []
        self.losses: list[float] = []

    def on_fit_start(self, trainer, pl_module) -> None:
        for module in pl_module.modules():
            if isinstance(module, ExpertParallelExperts):
                module.fp8_dispatch = self.fp8_dispatch
        for name in trainer.strategy.fp8_report.linears:  # torchao's FP8 (or MX) linears the strategy made
            module = pl_module.get_submodule(name)
            module.register_forward_hook(lambda *_, name=name: self.forwards.update([name]))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append(batch.detach().cpu().clone())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def fit(kind: str, schedule: str, vpp: int, overlap: bool, recipe: str, ep: int, world: int) -> dict:
    seed_everything(SEED)
    model = build(kind)
    record = Record(fp8_dispatch=recipe == "rowwise")
    strategy = MoEOverlapStrategy(ep=ep, pp=PP, vpp=vpp, pipeline_schedule=schedule, overlap=overlap,
                                  num_microbatches=M, fp8=recipe, timeout=120)  # fmt: skip
    trainer = Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[record],
    )  # fmt: skip
    trainer.fit(model, datamodule=SyntheticTokens(vocab_size=32, seq_len=S, batch_size=B, num_samples=64))
    coords = strategy.dims.coords(trainer.global_rank)
    held = {n for n, p in model.named_parameters() if not p.is_meta}
    return {
        "coords": (coords.pp, coords.dp, coords.ep),
        "params": {n: local(p).detach().clone() for n, p in model.named_parameters() if n in held},
        "losses": record.losses,
        "batches": record.batches,
        "forwards": dict(record.forwards),
        "held_fp8_linears": sorted(
            n for n in strategy.fp8_report.linears if not model.get_submodule(n).weight.is_meta
        ),
        "fp8_experts_held": sum(
            has_fp8_kernel(m) for m in model.modules() if not any(p.is_meta for p in m.parameters())
        ),
        "report_linears": len(strategy.fp8_report.linears),
    }


def worker(rank: int, world: int, ep: int, runs: tuple) -> dict:
    torch.use_deterministic_algorithms(True)
    return {name: fit(*run, ep=ep, world=world) for name, *run in runs}


def reference(kind: str, recipe: str | None, batches_by_dp: list[list[torch.Tensor]]) -> tuple[list[list[float]], dict]:
    """The unsplit model in one process (``apply_fp8`` with ``recipe``, or float32 for None) on every dp rank's
    batches: gradients the mean over dp ranks and micro-batches, SGD. Losses per dp rank and step. HF's experts are
    made expert-parallel at ep=1 first (``apply_fp8`` converts them once wrapped), as ``test_fp8_train_hf`` does."""
    torch.use_deterministic_algorithms(True)
    seed_everything(SEED)
    dp = len(batches_by_dp)
    model = build("gpt" if kind == "gpt-meta" else kind)
    if kind == "gpt-meta":  # the values each rank's chunks got: per module, seeded by the run's seed and its name
        seeded_init(model, SEED, gpt_init_module)
    if kind == "qwen3_moe":  # HF's experts take the FP8 kernel once wrapped: ep=1 over a loopback exchange
        apply_expert_parallel(model, None, runtime=CommRuntime(communicator=Loopback(0.0)))
    if recipe is not None:
        apply_fp8(model, recipe)
    for module in model.modules():  # each micro-batch backpropagates loss / (dp M): the routers' balancing loss too
        if isinstance(module, TopKRouter):
            module.aux_loss_scale = 1.0 / (dp * M)
    opt = model.configure_optimizers()
    losses: list[list[float]] = [[] for _ in range(dp)]
    for step in range(STEPS):
        opt.zero_grad()
        for d in range(dp):
            total = 0.0
            for micro in batches_by_dp[d][step].chunk(M):
                loss = model._loss(micro)
                (loss / (dp * M)).backward()
                total += float(loss.detach()) / M
            losses[d].append(total)
        opt.step()
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _expert_slice(name: str, ref: torch.Tensor, got: torch.Tensor, ep: int, ep_rank: int) -> torch.Tensor:
    if got.shape == ref.shape:
        return ref
    per = got.shape[0]
    assert ".experts." in name and per * ep == ref.shape[0], (name, got.shape, ref.shape)
    return ref[ep_rank * per : (ep_rank + 1) * per]


def check(results: list[dict], runs: tuple, ep: int) -> None:
    names = {run[0] for run in runs}
    for rank, ran in enumerate(results):
        for on, off in (pair for pair in PAIRS if set(pair) <= names):
            assert ran[on]["losses"] == ran[off]["losses"], (rank, on)
            assert ran[on]["params"].keys() == ran[off]["params"].keys()
            for name, p in ran[on]["params"].items():
                assert torch.equal(p, ran[off]["params"][name]), (rank, on, name)
    for name, kind, _, _, _, recipe in runs:
        by_dp = {r[name]["coords"][1]: r[name] for r in results if r[name]["coords"][0] == 0}
        batches_by_dp = [by_dp[d]["batches"] for d in sorted(by_dp)]
        ref_losses, ref_params = reference(kind, recipe, batches_by_dp)
        if recipe == "tensorwise":
            fp32_losses, _ = reference(kind, None, batches_by_dp)
        seen: set[str] = set()
        for rank, ran in enumerate(results):
            run = ran[name]
            want = ref_losses[run["coords"][1]]
            torch.testing.assert_close(run["losses"], want, rtol=RTOL, atol=0, msg=lambda m: f"{name} {rank}: {m}")
            if recipe == "tensorwise":
                torch.testing.assert_close(run["losses"], fp32_losses[run["coords"][1]], rtol=FP32_RTOL, atol=0)
            for pname, got in run["params"].items():
                ref = _expert_slice(pname, ref_params[pname], got, ep, run["coords"][2])
                torch.testing.assert_close(got, ref, rtol=RTOL, atol=RTOL, msg=lambda m: f"{name} {pname}: {m}")
                seen.add(pname)
            # FP8 where the chunks are: each held FP8 linear ran (as often as the others), none on meta did
            held = run["held_fp8_linears"]
            assert held and set(run["forwards"]) == set(held), (name, rank, run["forwards"], held)
            assert len(set(run["forwards"].values())) == 1 and min(run["forwards"].values()) >= STEPS * M
            assert run["fp8_experts_held"] > 0 and run["report_linears"] > len(held)  # the report: every chunk's
        assert seen == set(ref_params), (name, set(ref_params) - seen)


def test_fp8_on_pipeline_chunks_matches_the_unsplit_fp8_model() -> None:
    results = run_distributed(worker, PP, 1, RUNS, timeout_s=300)
    check(results, RUNS, ep=1)


@pytest.mark.long
def test_fp8_on_pipeline_chunks_under_the_other_schedules() -> None:
    results = run_distributed(worker, PP, 1, SCHEDULE_RUNS, timeout_s=300)
    check(results, SCHEDULE_RUNS, ep=1)


@pytest.mark.long
def test_fp8_on_pipeline_chunks_with_expert_parallel_dispatch() -> None:
    results = run_distributed(worker, 2 * PP, 2, WIDE_RUNS, timeout_s=400)
    check(results, WIDE_RUNS, ep=2)
