"""``MoEOverlapStrategy(pp=2, vpp=2, ep=2, shard="full" | "optimizer")`` on 4 gloo ranks (dp=2 per stage): each
rank's chunks sharded with FSDP2 (dense parameters over the stage's dp ranks; the experts' edp is 1 here, the
8-process test shards them too), under interleaved 1F1B with and without the overlap, and HF Qwen3-MoE under 1F1B
(vpp=1) with the overlap (its paired order).

Oracles, from one spawn:
- one process training the unsplit model on the same global batches (plain SGD, the gradients clipped by their
  global norm; no strategy code): the per-step losses within 1e-5 and every parameter of the consolidated state
  within 1e-5 after the steps, for ``MoEGPT``, HF Qwen3-MoE and HF DeepSeek-V3 (its correction bias);
- the overlapped schedule against the sequential one at ``shard="full"``: the consolidated states equal bitwise;
  and bitwise the same training whatever else is set: ``shard="none"``, optimizer CPU offload (AdamW), FP8 with the
  float8 all-gather (against FP8 at ``"none"``), ``overlap_grad_reduce`` in both sharded modes, whose record of
  events shows the later chunk's layer reduced while the earlier chunk's last backward still runs;
- per rank, what it holds: its chunks' dense parameters ``Shard(0)`` over its stage's 2 dp ranks (at rest in
  ``"full"``; in the optimizer in ``"optimizer"``, the module holding the gathered ones), the other stage's
  chunks on meta, and its dense bytes half those of ``shard="none"``;
- checkpoints (AdamW, one step per epoch, saved each epoch): resumed from epoch 0 at the same layout, the loss
  curve continues bitwise; resumed at pp=1 (dp=4, shard "optimizer") and at pp=2 with ``shard="none"``, the
  global loss per step within 1e-5 of the unbroken run (the optimizer state resharded across pp and dp).

Shapes: G samples per step over all dp ranks, S tokens per sample, M micro-batches per dp rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Subset

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.optim.host_offload import describe_offload
from tests.helpers.distributed import run_distributed
from tests.helpers.runs import assert_same_training
from tests.helpers.sgd import SGDGPT, SGDDeepSeek, SGDQwen3
from tests.helpers.unsplit import correction_bias_steps, train_unsplit

WORLD, PP, VPP, EP, DP, M, G, S, VOCAB, STEPS, CLIP = 4, 2, 2, 2, 2, 4, 8, 6, 32, 2, 0.5
GPT = {"vocab_size": VOCAB, "hidden_size": 16, "num_layers": 4, "num_heads": 2, "num_experts": 4, "top_k": 2,
       "ffn_hidden_size": 8, "aux_loss_coeff": 0.0}  # fmt: skip
BIAS_RATE = 1e-3  # the documented default step of DeepSeek-V3's correction bias (docs/monitoring.md)
RUNS = (  # (name, model, shard, overlap, other settings)
    ("gpt-full", "gpt", "full", True, {}),
    ("gpt-full-off", "gpt", "full", False, {}),
    ("gpt-optimizer", "gpt", "optimizer", True, {}),
    ("gpt-none", "gpt", "none", True, {}),
    ("qwen3-full", "qwen3", "full", True, {}),
    ("qwen3-full-off", "qwen3", "full", False, {}),
    ("deepseek-full", "deepseek", "full", True, {}),
    ("deepseek-full-off", "deepseek", "full", False, {}),
    ("adamw-full", "adamw", "full", True, {}),
    ("adamw-full-offload", "adamw", "full", True, {"optimizer_cpu_offload": True}),
    ("fp8-full", "gpt", "full", True, {"fp8": "tensorwise"}),  # the dense weights all-gathered in float8
    ("fp8-none", "gpt", "none", True, {"fp8": "tensorwise"}),
    ("gpt-full-early", "gpt", "full", True, {"overlap_grad_reduce": True}),
    ("gpt-optimizer-early", "gpt", "optimizer", True, {"overlap_grad_reduce": True}),
    ("qwen3-full-1f1b", "qwen3", "full", True, {"pipeline_schedule": "1f1b", "vpp": 1}),  # its paired order
)
PAIRS = (("gpt-full", "gpt-full-off"), ("qwen3-full", "qwen3-full-off"), ("deepseek-full", "deepseek-full-off"))
# the same training whatever is sharded, offloaded or gathered in float8 (module docstring)
SAME = (
    ("gpt-full", "gpt-none"), ("adamw-full", "adamw-full-offload"), ("fp8-full", "fp8-none"),
    ("gpt-full-early", "gpt-full"), ("gpt-optimizer-early", "gpt-optimizer"),
)  # fmt: skip
RESUME_EPOCHS, RESUMED_FROM = 3, "epoch=0-step=1.ckpt"  # one step per epoch


def build(kind: str) -> LightningModule:
    torch.manual_seed(0)
    if kind == "gpt":
        return SGDGPT(**GPT)
    if kind == "qwen3":
        return SGDQwen3()
    if kind == "adamw":
        return MoEGPT(**GPT, lr=1e-2)
    return SGDDeepSeek(vocab=VOCAB)


def tokens(steps: int) -> torch.Tensor:
    """``[steps * G, S]``: the samples of every step, in order (step ``s`` takes rows ``s * G`` to ``(s + 1) * G``)."""
    return torch.randint(0, VOCAB, (steps * G, S), generator=torch.Generator().manual_seed(7))


def loader(dp_rank: int, dp: int, steps: int) -> DataLoader:
    """This dp rank's share of each step's G samples, in order (every pp rank of a stage reads the same)."""
    per = G // dp
    index = [s * G + dp_rank * per + i for s in range(steps) for i in range(per)]
    return DataLoader(Subset(tokens(steps), index), batch_size=per)


def _layout(tensors) -> list[tuple]:
    """(placements, mesh shape, local shape, global shape) per tensor; a plain tensor has no placements."""
    out = []
    for t in tensors:
        if isinstance(t, DTensor):
            out.append((tuple(map(str, t.placements)), tuple(t.device_mesh.shape), tuple(t.to_local().shape),
                        tuple(t.shape)))  # fmt: skip
        else:
            out.append(((), (), tuple(t.shape), tuple(t.shape)))
    return out


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


class Reductions(Callback):
    """Every step's events: ``("step", i)``, the early reduction's ``(event, unit)`` and, from this test's own module
    hooks, ``("backward", k)`` each time a backward of held layer ``k`` (MoEGPT) ended."""

    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []

    def on_train_start(self, trainer, pl_module) -> None:
        trainer.strategy.prepared.sharded.observe_reduction(lambda event, unit: self.events.append((event, unit)))
        for k, layer in enumerate(pl_module.layers):
            if not next(layer.parameters()).is_meta:
                layer.register_full_backward_hook(
                    lambda module, grad_in, grad_out, k=k: self.events.append(("backward", k))
                )

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.events.append(("step", batch_idx))


def _trainer(strategy: MoEOverlapStrategy, callbacks: list, world: int = WORLD, **kwargs) -> Trainer:
    return Trainer(
        accelerator="cpu", devices=world, strategy=strategy, logger=False, limit_val_batches=0,
        use_distributed_sampler=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
        **kwargs,
    )  # fmt: skip


def fit(kind: str, shard: str, overlap: bool, settings: dict, world: int = WORLD, micro: int = M) -> dict:
    model = build(kind)
    settings = {"vpp": VPP, **settings}
    strategy = MoEOverlapStrategy(
        ep=EP, pp=PP, shard=shard, overlap=overlap, num_microbatches=micro, timeout=120, **settings
    )
    losses, reductions = Losses(), Reductions()
    early = [reductions] if settings.get("overlap_grad_reduce") else []
    trainer = _trainer(strategy, [losses, *early], world, max_steps=STEPS, gradient_clip_val=CLIP,
                       enable_checkpointing=False)  # fmt: skip
    coords = strategy.dims.coords(trainer.global_rank)
    trainer.fit(model, train_dataloaders=loader(coords.dp, strategy.dims.dp, STEPS))
    held = [(n, p) for n, p in model.named_parameters() if not p.is_meta]
    # the user's optimizer holds the whole model's parameters; the other stage's stay on meta, without gradients
    optimizer_params = [p for group in trainer.optimizers[0].param_groups for p in group["params"] if not p.is_meta]
    return {
        "coords": (coords.pp, coords.dp),
        "losses": losses.losses,
        "module": _layout(p for _, p in held),
        "optimizer": _layout(optimizer_params),
        "meta": sorted(n for n, p in model.named_parameters() if p.is_meta),
        "dense_bytes": sum(p.to_local().nbytes for p in optimizer_params if p.ndim < 3),  # MoEGPT's experts: 3-D
        "full": strategy.full_state_dict(),  # collective: the consolidated state on rank 0
        "float8_all_gather": strategy.fp8_report is not None and strategy.fp8_report.float8_all_gather,
        "offload": describe_offload(trainer.optimizers),
        "events": reductions.events,
        "units": [name for name, _ in strategy.prepared.sharded.named_units()],
    }


def resumed(root: Path, run: str, pp: int, shard: str, ckpt: Path | None) -> dict:
    """AdamW ``MoEGPT`` for ``RESUME_EPOCHS`` epochs of one step (from ``ckpt``), checkpointing each epoch."""
    model = build("adamw")
    layout = {"pp": pp, "vpp": VPP} if pp > 1 else {}
    micro = M if pp > 1 else M // 2  # the same global micro-batches: dp=2 x 4 of one sample, dp=4 x 2
    strategy = MoEOverlapStrategy(ep=EP, shard=shard, num_microbatches=micro, timeout=120, **layout)
    losses = Losses()
    save = ModelCheckpoint(dirpath=root / run, save_top_k=-1, every_n_epochs=1)
    trainer = _trainer(strategy, [losses, save], max_epochs=RESUME_EPOCHS, gradient_clip_val=CLIP,
                       default_root_dir=root / run)  # fmt: skip
    coords = strategy.dims.coords(trainer.global_rank)
    trainer.fit(model, train_dataloaders=loader(coords.dp, strategy.dims.dp, 1), ckpt_path=ckpt)
    return {"losses": losses.losses, "dp": coords.dp, "dp_size": strategy.dims.dp}


def worker(rank: int, world: int, root: Path) -> dict:
    torch.use_deterministic_algorithms(True)
    out: dict = {name: fit(kind, shard, overlap, settings) for name, kind, shard, overlap, settings in RUNS}
    saved = root / "full" / RESUMED_FROM
    out["resumes"] = {
        "full": resumed(root, "full", PP, "full", None),
        "full-resumed": resumed(root, "full-resumed", PP, "full", saved),
        "pp1-optimizer": resumed(root, "pp1-optimizer", 1, "optimizer", saved),
        "pp2-none": resumed(root, "pp2-none", PP, "none", saved),
    }
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_distributed(worker, WORLD, tmp_path_factory.mktemp("pipeline_sharded"), timeout_s=400)


def reference(kind: str, dp: int = DP, micro: int = M) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """The unsplit model in one process: per step, each of ``dp`` ranks' ``micro`` micro-batches backpropagates
    ``loss / (dp * micro)``, the gradients are clipped to ``CLIP`` by their global norm, SGD steps; DeepSeek-V3's
    correction biases then move by ``BIAS_RATE * sign(mean - count)`` from the step's routed counts (taken by a hook
    here). Returns each dp rank's per-step loss (the mean over its micro-batches) and the final state."""
    torch.use_deterministic_algorithms(True)
    model = build(kind)
    opt = model.configure_optimizers()
    data, per = tokens(STEPS), G // dp
    batches = [[data[s * G + d * per : s * G + (d + 1) * per] for d in range(dp)] for s in range(STEPS)]
    losses = train_unsplit(model, opt, batches, micro, CLIP, after_step=correction_bias_steps(model, BIAS_RATE))
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("kind", ["gpt", "qwen3", "deepseek"])
def test_sharded_pipeline_matches_one_process(results: list[dict], kind: str) -> None:
    ref_losses, ref_state = reference(kind)
    names = [name for name, k, *_, settings in RUNS if k == kind and set(settings) <= {"pipeline_schedule", "vpp"}]
    for name in names:
        for rank, runs in enumerate(results):
            run = runs[name]
            want = ref_losses[run["coords"][1]]
            assert len(run["losses"]) == STEPS, (name, rank)
            for got, w in zip(run["losses"], want):
                assert abs(got - w) < 1e-5, (name, rank, run["losses"], want)
        full = results[0][name]["full"]
        assert all(r[name]["full"] is None for r in results[1:])
        assert set(full) == set(ref_state), (name, set(full) ^ set(ref_state))
        for key, want in ref_state.items():
            torch.testing.assert_close(full[key], want, rtol=1e-5, atol=1e-5, msg=f"{name} {key}")
        assert any(not torch.equal(full[k], v) for k, v in build(kind).state_dict().items())  # the steps moved it


def test_overlap_on_equals_off_bitwise_and_what_is_sharded_changes_nothing(results: list[dict]) -> None:
    for runs in results:  # what the settings ask for ran
        assert runs["fp8-full"]["float8_all_gather"] and not runs["fp8-none"]["float8_all_gather"]
        assert ", 100%) on the host" in runs["adamw-full-offload"]["offload"], runs["adamw-full-offload"]["offload"]
    assert_same_training(results, PAIRS + SAME)


@pytest.mark.parametrize("shard", ["full", "optimizer"])
def test_each_rank_holds_its_chunks_shards(results: list[dict], shard: str) -> None:
    for rank, runs in enumerate(results):
        run, replicated = runs[f"gpt-{shard}"], runs["gpt-none"]
        assert run["meta"] and run["meta"] == replicated["meta"], rank  # the other stage's chunks: on meta
        experts = 0
        for layout in run["optimizer"]:
            placements, mesh_shape, local, full = layout
            if len(full) == 3:  # MoEGPT's experts ([E, ...]), over (edp, ep) with edp = 1: E / ep experts per rank
                assert mesh_shape == (1, EP) and placements[-1] == "S(0)" and local[0] * EP == full[0], layout
                experts += 1
            else:  # dense, over the stage's dp ranks: dim 0 in 2 (torch.chunk: the last rank may hold fewer rows)
                assert mesh_shape == (DP,) and placements == ("S(0)",), layout
                assert local[0] <= -(-full[0] // DP) and local[1:] == full[1:], layout
        assert experts == 2 * GPT["num_layers"] // PP, (rank, experts)  # 2 tensors per layer, half the layers here
        if shard == "full":  # at rest the module holds the shards themselves
            assert run["module"] == run["optimizer"], rank
        else:  # "optimizer": the module holds the gathered dense parameters between steps
            dense = [m for m in run["module"] if len(m[3]) < 3]
            assert dense and all(placements == () and local == full for placements, _, local, full in dense), rank
        ratio = run["dense_bytes"] / replicated["dense_bytes"]
        assert 0.5 <= ratio <= 0.5 + 0.1, (rank, shard, ratio)  # half, up to the uneven rows of torch.chunk


def test_checkpoint_resumes_bitwise_and_at_pp1_and_unsharded(results: list[dict]) -> None:
    def global_losses(run: str) -> list[float]:  # the mean over the dp ranks of each step's loss
        per_dp = {r["resumes"][run]["dp"]: r["resumes"][run]["losses"] for r in results}
        size = results[0]["resumes"][run]["dp_size"]
        assert sorted(per_dp) == list(range(size))
        return [sum(per_dp[d][s] for d in range(size)) / size for s in range(len(per_dp[0]))]

    for rank, runs in enumerate(results):
        unbroken = runs["resumes"]["full"]["losses"]
        assert len(unbroken) == RESUME_EPOCHS and len(set(unbroken)) == RESUME_EPOCHS
        assert runs["resumes"]["full-resumed"]["losses"] == unbroken[1:], rank  # the same layout: bitwise
    unbroken = global_losses("full")
    for run in ("pp1-optimizer", "pp2-none"):
        got = global_losses(run)
        assert len(got) == RESUME_EPOCHS - 1, run
        for g, w in zip(got, unbroken[1:]):
            assert abs(g - w) < 1e-5, (run, got, unbroken)


@pytest.mark.parametrize("shard", ["full", "optimizer"])
def test_early_reduction_reduces_each_chunk_during_the_steps_last_backwards(results: list[dict], shard: str) -> None:
    """With ``overlap_grad_reduce``, each held chunk's units are armed before that chunk's last backward: the later
    chunk's layer (e.g. layers.2 on the first stage) is reduced while the earlier chunk's layer (layers.0) still runs
    its last backward, and nothing is issued before the later chunk's last backward (the parameters are bitwise
    those of the flag off: the test above)."""
    for rank, runs in enumerate(results):
        run = runs[f"gpt-{shard}-early"]
        low, high = sorted({k for event, k in run["events"] if event == "backward"})  # the held layers
        assert {f"layers.{low}", f"layers.{high}", f"layers.{high}.mlp.experts"} <= set(run["units"]), run["units"]
        steps, current = [], None
        for event in run["events"]:
            if event[0] == "step":
                current = []
                steps.append(current)
            else:
                current.append(event)
        assert len(steps) == STEPS, rank
        for step in steps:
            issued = [unit for event, unit in step if event == "issue"]
            # each unit once; the roots are the chunks, named "", and one per rank holds parameters of its own (the
            # embedding on the first stage, the norm and head on the last)
            assert sorted(issued) == sorted(set(run["units"])), (rank, issued)
            assert sorted(u for e, u in step if e == "reduced") == sorted(issued)
            grads = {k: [i for i, e in enumerate(step) if e == ("backward", k)] for k in (low, high)}
            # one per micro-batch's backward (the first step's stage initialisation runs one more, first)
            assert len(grads[low]) in (M, M + 1) and len(grads[high]) in (M, M + 1), (rank, grads)
            first_issue = step.index(("issue", issued[0]))
            assert first_issue > grads[high][-2], (rank, step)  # nothing before the later chunk's last backward
            for unit in (f"layers.{high}", f"layers.{high}.mlp.experts"):  # while the earlier chunk still runs
                assert step.index(("issue", unit)) < grads[low][-1], (rank, unit, step)
