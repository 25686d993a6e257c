"""``Trainer(strategy=MoEOverlapStrategy(pp=2, vpp=2, ep=2))`` on 4 gloo ranks (dp=2), ``MoEGPT`` with 4 layers.

One spawn, several fits on the same processes:
- overlap on vs off under the same schedule, parameters after the steps ``torch.equal`` on every rank: interleaved
  1F1B, DualPipeV and 1F1B (vpp=1, its paired order; DualPipeV and 1F1B with ``SelectiveRecompute`` attached by
  the Trainer to each rank's chunks) on ``MoEGPT``, and interleaved 1F1B on HF Qwen3-MoE;
- those runs and plain 1F1B (vpp=1) against a single-process run of the unsplit model on the same global batches
  (the batches each rank saw, recorded): per-step losses within 1e-5, parameters allclose, with gradient clipping
  by the global norm (across pp, ep and dp) active;
- the Lightning contract: the loss Lightning gets is the same on every rank, ``train_loss`` (logged by the loss
  function on the last stage) reaches every rank's ``callback_metrics``, validation runs the forward-only pipeline
  and logs ``val_loss`` everywhere, each rank holds only its own chunks (the others on meta); a model built on
  the meta device gets each rank's chunks initialised as ``seeded_init`` initialises the unsplit model;
- checkpoints: saved at pp=2 (sharded, keyed by the unsplit names) and loaded at pp=1 through ``fit(ckpt_path=)``,
  the consolidated export of both equal bitwise.

Shapes: B samples per dp rank and step, S tokens, M micro-batches.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from lightning_moe_overlap import MoEOverlapStrategy, SelectiveRecompute
from lightning_moe_overlap.demo import MoEGPT, SyntheticTokens, gpt_init_module
from lightning_moe_overlap.parallel.dtensors import local
from lightning_moe_overlap.pipeline.split import seeded_init
from tests.helpers.distributed import run_distributed
from tests.helpers.sgd import SGDGPT, SGDQwen3
from tests.helpers.unsplit import train_unsplit

WORLD, PP, EP, DP, M, B, STEPS, CLIP, SEED = 4, 2, 2, 2, 4, 4, 2, 0.5, 0
MODEL = dict(vocab_size=32, hidden_size=16, num_layers=4, num_heads=2, num_experts=4, top_k=2, ffn_hidden_size=8,
             aux_loss_coeff=0.0)  # fmt: skip
DATA = dict(vocab_size=32, seq_len=6, batch_size=B, num_samples=64)
RUNS = (  # (name, model, schedule, vpp, overlap)
    ("interleaved", "gpt", "interleaved_1f1b", 2, True),
    ("interleaved-off", "gpt", "interleaved_1f1b", 2, False),
    ("dualpipev", "gpt", "dualpipev", 2, True),
    ("dualpipev-off", "gpt", "dualpipev", 2, False),
    ("1f1b", "gpt-meta", "1f1b", 1, False),  # built on meta: each rank initialises only its own chunks
    ("1f1b-overlap", "gpt-meta", "1f1b", 1, True),  # the paired order (pipeline/paired_1f1b.py), with recompute
    ("hf-interleaved", "qwen3_moe", "interleaved_1f1b", 2, True),
    ("hf-interleaved-off", "qwen3_moe", "interleaved_1f1b", 2, False),
)
PAIRS = (("interleaved", "interleaved-off"), ("dualpipev", "dualpipev-off"), ("hf-interleaved", "hf-interleaved-off"),
         ("1f1b-overlap", "1f1b"))  # fmt: skip


class MetaGPT(SGDGPT):
    """Built on the meta device (as ``configure_model`` builds at pp > 1): the strategy allocates each rank's chunks
    and initialises them with ``seeded_init`` under the run's seed."""

    def __init__(self) -> None:
        with torch.device("meta"):
            super().__init__(**MODEL)


def build(kind: str) -> MoEGPT | SGDQwen3:
    return {"gpt": lambda: SGDGPT(**MODEL), "gpt-meta": MetaGPT, "qwen3_moe": SGDQwen3}[kind]()


class Record(Callback):
    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []
        self.val_batches: list[torch.Tensor] = []
        self.losses: list[float] = []
        self.logged: list[float] = []  # `train_loss` of each step, as Lightning holds it once the step is done

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append(batch.detach().cpu().clone())
        if batch_idx > 0:
            self.logged.append(float(trainer.callback_metrics["train_loss"]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module) -> None:
        self.logged.append(float(trainer.callback_metrics["train_loss"]))

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self.val_batches.append(batch.detach().cpu().clone())


def fit(kind: str, schedule: str, vpp: int, overlap: bool, validate: bool, save_to: str | None = None) -> dict:
    model = build(kind)
    record = Record()
    # recompute attached by the Trainer to this rank's chunks (its values are the oracle's: recompute is exact)
    recompute = SelectiveRecompute(modules=["moe_act"]) if schedule in ("dualpipev", "1f1b") else None  # on and off
    strategy = MoEOverlapStrategy(
        ep=EP, pp=PP, vpp=vpp, pipeline_schedule=schedule, overlap=overlap, num_microbatches=M, timeout=120
    )
    trainer = Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=STEPS, limit_train_batches=STEPS,
        limit_val_batches=1 if validate else 0, num_sanity_val_steps=0, gradient_clip_val=CLIP, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[record] + ([recompute] if recompute else []),
    )  # fmt: skip
    attached: list[tuple[int, int]] = []  # (handles the Trainer's callback installed, those apply(chunks) installs)

    def count_handles() -> None:  # runs after on_fit_start attached the callback
        probe = SelectiveRecompute(modules=["moe_act"])
        counts = []
        probe.apply(list(strategy.pipeline_chunks))
        counts.append(len(probe._handles))
        probe.remove()
        attached.append((len(recompute._handles), *counts))

    if recompute is not None:
        model.on_train_start = count_handles
    trainer.fit(model, datamodule=SyntheticTokens(**DATA))
    full = None
    if save_to is not None:
        trainer.save_checkpoint(save_to)  # sharded: each rank writes what it holds, keyed by the unsplit names
        full = strategy.full_state_dict()  # every stage and expert gathered on rank 0
    coords = strategy.dims.coords(trainer.global_rank)
    params = {n: local(p).detach().clone() for n, p in model.named_parameters() if not p.is_meta}
    return {
        "coords": (coords.pp, coords.dp, coords.ep),
        "params": params,
        "meta": sorted(n for n, p in model.named_parameters() if p.is_meta),
        "losses": record.losses,
        "logged": record.logged,
        "batches": record.batches,
        "val_batches": record.val_batches,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "full": full,
        "recompute_handles": attached,
        "chunks": None if strategy.pipeline_chunks is None else len(strategy.pipeline_chunks),
    }


def resume_at_pp1(path: str) -> dict | None:
    """Load the pp=2 checkpoint at pp=1, ep=2 (dp=4) through ``fit(ckpt_path=...)``: the full state on rank 0."""
    model = SGDGPT(**MODEL)
    strategy = MoEOverlapStrategy(ep=EP, num_microbatches=M, timeout=120)
    trainer = Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=STEPS, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, datamodule=SyntheticTokens(**DATA), ckpt_path=path)  # resumes at max_steps: loads, no step
    return strategy.full_state_dict()


def worker(rank: int, world_size: int, checkpoint: str) -> dict:
    torch.use_deterministic_algorithms(True)
    seed_everything(SEED)
    runs = {
        name: fit(*run, validate=name == "interleaved", save_to=checkpoint if name == "interleaved" else None)
        for name, *run in RUNS
    }
    return {**runs, "resumed": resume_at_pp1(checkpoint)}


def reference(
    kind: str, batches: list[torch.Tensor], val_batches: list[torch.Tensor]
) -> tuple[list[list[float]], dict, float]:
    """The unsplit model in one process on the global batches (gradients: the mean over dp ranks and micro-batches;
    clipping, SGD). Losses per dp rank and step: the mean over that rank's micro-batches, as each rank reports it."""
    torch.use_deterministic_algorithms(True)
    model = build("gpt" if kind == "gpt-meta" else kind)
    if kind == "gpt-meta":  # the values each rank's chunks got: per module, seeded by the run's seed and its name
        seeded_init(model, SEED, gpt_init_module)
    opt = model.configure_optimizers()
    steps = [[batches[d * STEPS + step] for d in range(DP)] for step in range(STEPS)]
    losses = train_unsplit(model, opt, steps, M, CLIP)
    with torch.no_grad():
        val = sum(float(model._loss(micro)) for vb in val_batches for micro in vb.chunk(M)) / max(1, len(val_batches) * M)
    return losses, {n: p.detach() for n, p in model.named_parameters()}, val


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    cache = os.environ.get("PIPELINE_STRATEGY_RESULTS")  # a pickle of the spawn's results, to iterate on the checks
    if cache and os.path.exists(cache):
        with open(cache, "rb") as f:
            return pickle.load(f)
    checkpoint = str(tmp_path_factory.mktemp("pipeline") / "step2.ckpt")
    out = run_distributed(worker, WORLD, checkpoint, timeout_s=300)
    if cache:
        with open(cache, "wb") as f:
            pickle.dump(out, f)
    return out


def _expert_slice(name: str, ref: torch.Tensor, got: torch.Tensor, ep_rank: int) -> torch.Tensor:
    if got.shape == ref.shape:
        return ref
    per = got.shape[0]
    assert ".experts." in name and per * EP == ref.shape[0], (name, got.shape, ref.shape)
    return ref[ep_rank * per : (ep_rank + 1) * per]


def test_overlap_on_equals_off_bitwise_on_every_rank(results: list[dict]) -> None:
    for rank, runs in enumerate(results):
        for on, off in PAIRS:
            assert runs[on]["losses"] == runs[off]["losses"], (rank, on)
            assert runs[on]["params"].keys() == runs[off]["params"].keys()
            for name, p in runs[on]["params"].items():
                assert torch.equal(p, runs[off]["params"][name]), (rank, on, name)


def test_pipeline_runs_match_the_unsplit_model(results: list[dict]) -> None:
    first = [r for r in results if r["1f1b"]["coords"][0] == 0]  # one rank per dp index on pp rank 0
    by_dp = {r["1f1b"]["coords"][1]: r for r in first}
    for name, kind, _, vpp, _ in RUNS:
        batches = [b for d in range(DP) for b in by_dp[d][name]["batches"]]
        val_batches = [b for d in range(DP) for b in by_dp[d][name]["val_batches"]]
        ref_losses, ref_params, ref_val = reference(kind, batches, val_batches)
        seen: set[str] = set()
        for rank, runs in enumerate(results):
            run = runs[name]
            dp_losses = ref_losses[run["coords"][1]]
            assert len(run["losses"]) == STEPS
            for got, want in zip(run["losses"], dp_losses):
                assert abs(got - want) < 1e-5, (name, rank, run["losses"], dp_losses)
            assert abs(run["metrics"]["train_loss"] - dp_losses[-1]) < 1e-5, (name, rank, run["metrics"])
            # every step's logged loss, the first one too (torch's shape inference runs the loss once more then)
            assert len(run["logged"]) == STEPS
            for got, want in zip(run["logged"], dp_losses):
                assert abs(got - want) < 1e-5, (name, rank, run["logged"], dp_losses)
            if name == "interleaved":
                assert abs(run["metrics"]["val_loss"] - ref_val) < 1e-5, (rank, run["metrics"], ref_val)
            for pname, got in run["params"].items():
                want = _expert_slice(pname, ref_params[pname], got, run["coords"][2])
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} {pname}: {m}")
                seen.add(pname)
            assert run["chunks"] == vpp, (name, rank, run["chunks"])
            if name.startswith("dualpipev") or name.startswith("1f1b"):
                installed, on_chunks = run["recompute_handles"][0]
                assert installed == on_chunks > 0, run["recompute_handles"]  # what apply(held chunks) installs
            assert set(run["meta"]).isdisjoint(run["params"])
            assert run["meta"], (name, rank)  # the other pp rank's chunks are not allocated here
        assert seen == set(ref_params), (name, set(ref_params) - seen)  # every parameter is trained somewhere


def test_checkpoint_from_pp2_loads_at_pp1_and_exports_the_unsplit_model(results: list[dict]) -> None:
    """Saved at pp=2 x ep=2 (sharded, keyed by the unsplit names), loaded at pp=1 x ep=2: the consolidated export
    of both runs is the unsplit model's state dict, equal bitwise; it matches the unsplit reference too."""
    saved, resumed = results[0]["interleaved"]["full"], results[0]["resumed"]
    assert all(r["interleaved"]["full"] is None and r["resumed"] is None for r in results[1:])
    reference_keys = set(SGDGPT(**MODEL).state_dict())
    assert set(saved) == reference_keys == set(resumed)
    for key, value in saved.items():
        assert torch.equal(resumed[key], value), key
    by_dp = {r["interleaved"]["coords"][1]: r for r in results if r["interleaved"]["coords"][0] == 0}
    batches = [b for d in range(DP) for b in by_dp[d]["interleaved"]["batches"]]
    _, ref_params, _ = reference("gpt", batches, [])
    for name, want in ref_params.items():
        torch.testing.assert_close(saved[name], want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
