"""``MoEOverlapStrategy(ep=2, shard=...)`` on 4 gloo ranks (dp=4, edp=2): FSDP2 over dp for dense parameters, over
edp for experts, ``MoEGPT`` and HF Qwen3-MoE, AdamW, clipping by the global norm, 2 micro-batches.

Oracles, all from one spawn: per-step losses and global gradient norms follow single-process training on the same
global batches (1e-5, float32); the overlapped schedule (also with delayed expert weight gradients) leaves the
parameters bitwise equal to the sequential one; per rank, the parameters are DTensors with the expected placements
and local shapes (``"full"``: the module holds the shards at rest; ``"optimizer"``: the optimizer holds them and
the module the gathered parameters); bf16-true, bf16-mixed and FSDP's ``MixedPrecisionPolicy`` run with sharding,
and so do validation forwards between steps; ``benchmarks/sharding_memory.py``'s measurement comes within 10% of
its formula. Checkpoints: a ``"full"``-sharded run at ep=2 saved after each epoch resumes bitwise at the same
layout, and its checkpoint continues the loss curve within 1e-6 at ep=4 (``"optimizer"``) and at ep=1 unsharded;
``"full"`` at ep=4 (an expert shard group of one rank) trains the same curve.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.demo_hf import HFMoECausalLM
from lightning_moe_overlap.moe.ep import ExpertParallelExperts
from tests.helpers.data import RandomTokens
from tests.helpers.distributed import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import sharding_memory  # noqa: E402

WORLD, EP, STEPS, BATCH, MICRO, CLIP, VOCAB = 4, 2, 3, 4, 2, 0.5, 64


class Tokens(RandomTokens):
    def __init__(self, n: int = 48, seq: int = 8) -> None:
        super().__init__(n, seq, VOCAB, seed=5, indexed=True)


def _build(name: str):
    torch.manual_seed(0)
    if name == "qwen3_moe":
        return HFMoECausalLM("qwen3_moe", lr=1e-2, config_overrides={"vocab_size": VOCAB})
    return MoEGPT(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_experts=4, top_k=2,
                  ffn_hidden_size=16, aux_loss_coeff=0.0, lr=1e-2)  # fmt: skip


def _recorder(name: str):
    model = _build(name)
    model.seen, model.norms, model.losses = [], [], []
    step = model.training_step

    def training_step(batch, batch_idx):
        tokens, idx = batch
        model.seen.extend(idx.tolist())
        return step(tokens, batch_idx)

    model.training_step = training_step
    model.on_before_optimizer_step = lambda optimizer: model.norms.append(
        float(model.trainer.strategy.global_grad_norm())
    )

    def on_train_batch_end(outputs, *_) -> None:  # after the optimizer step: the parameters as held between steps
        model.losses.append(float(outputs["loss"]))
        model.at_rest = _layout(model.parameters())

    model.on_train_batch_end = on_train_batch_end
    model.train_dataloader = lambda: DataLoader(Tokens(), batch_size=BATCH)
    return model


def _layout(tensors) -> list[tuple]:
    """(kind, placements, mesh shape, local shape, global shape) per tensor."""
    out = []
    for t in tensors:
        if isinstance(t, DTensor):
            out.append(("dtensor", tuple(map(str, t.placements)), tuple(t.device_mesh.shape),
                        tuple(t.to_local().shape), tuple(t.shape)))  # fmt: skip
        else:
            out.append(("tensor", (), (), tuple(t.shape), tuple(t.shape)))
    return out


def _fit(name: str, shard: str, overlap: bool, precision: str = "32-true", mp_policy=None, delay_wgrad=False) -> dict:
    model = _recorder(name)
    # MoEGPT also validates (sanity check before the first step, and after step 2): forwards outside a step
    model.val_dataloader = lambda: DataLoader(Tokens().data[:8], batch_size=BATCH)
    validate = {"limit_val_batches": 1, "val_check_interval": 2} if name == "moegpt" else {"limit_val_batches": 0}
    trainer = Trainer(
        accelerator="cpu", devices=WORLD, max_steps=STEPS, gradient_clip_val=CLIP, logger=False, precision=precision,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **validate,
        strategy=MoEOverlapStrategy(ep=EP, num_microbatches=MICRO, overlap=overlap, shard=shard,
                                    fsdp_mp_policy=mp_policy, delay_wgrad=delay_wgrad),
    )  # fmt: skip
    trainer.fit(model)
    experts = {id(p) for m in model.modules() if isinstance(m, ExpertParallelExperts) for p in m.parameters()}
    optimizer_params = [p for g in trainer.optimizers[0].param_groups for p in g["params"]]
    return {
        "losses": model.losses, "norms": model.norms, "seen": model.seen,
        "validated": "val_loss" in trainer.callback_metrics,
        "module": model.at_rest, "optimizer": _layout(optimizer_params),
        "is_expert": [id(p) in experts for p in model.parameters()],
        "shards": [(p.to_local() if isinstance(p, DTensor) else p).detach().clone() for p in optimizer_params],
    }  # fmt: skip


MEMORY_SHAPE = sharding_memory.Shape(vocab=256, hidden=64, layers=2, experts=4, ffn=64)
CASES = [(name, shard) for name in ("moegpt", "qwen3_moe") for shard in ("full", "optimizer")]


RESUME_EPOCHS, RESUMED_FROM = 4, "epoch=1-step=2.ckpt"  # one step per epoch: Tokens(16) over 4 ranks x BATCH


def _resumed(root: Path, run: str, shard: str, ep: int, ckpt: Path | None) -> list[float]:
    """The per-step losses of MoEGPT trained for ``RESUME_EPOCHS`` epochs (from ``ckpt``), checkpointing each."""
    model = _recorder("moegpt")
    model.train_dataloader = lambda: DataLoader(Tokens(n=WORLD * BATCH), batch_size=BATCH)
    trainer = Trainer(
        accelerator="cpu", devices=WORLD, max_epochs=RESUME_EPOCHS, gradient_clip_val=CLIP, logger=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, default_root_dir=root / run,
        callbacks=[ModelCheckpoint(dirpath=root / run, save_top_k=-1, every_n_epochs=1)],
        strategy=MoEOverlapStrategy(ep=ep, num_microbatches=MICRO, shard=shard),
    )  # fmt: skip
    trainer.fit(model, ckpt_path=ckpt)
    return model.losses


def _resumes(root: Path) -> dict[str, list[float]]:
    saved = root / "full_ep2" / RESUMED_FROM
    return {
        "full_ep2": _resumed(root, "full_ep2", "full", EP, None),
        "full_ep2_resumed": _resumed(root, "full_ep2_resumed", "full", EP, saved),
        "optimizer_ep4": _resumed(root, "optimizer_ep4", "optimizer", 4, saved),
        "none_ep1": _resumed(root, "none_ep1", "none", 1, saved),
        "full_ep4": _resumed(root, "full_ep4", "full", 4, None),  # edp=1: the experts' shard group is one rank
    }


def _worker(rank: int, world: int, root: Path) -> dict:
    torch.set_num_threads(1)
    results = {"resumes": _resumes(root)}
    for name, shard in CASES:
        results[(name, shard, True)] = _fit(name, shard, overlap=True)
        results[(name, shard, False)] = _fit(name, shard, overlap=False)
    for precision in ("bf16-true", "bf16-mixed"):
        results[("moegpt", precision)] = _fit("moegpt", "full", overlap=True, precision=precision)
    results[("moegpt", "full", "delay_wgrad")] = _fit("moegpt", "full", overlap=True, delay_wgrad=True)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    results[("moegpt", "fsdp_mp_policy")] = _fit("moegpt", "full", overlap=True, mp_policy=policy)
    results["memory"] = sharding_memory.worker(rank, world, MEMORY_SHAPE, EP)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_distributed(_worker, WORLD, tmp_path_factory.mktemp("sharding"), timeout_s=360)


def _reference(name: str, seen_per_rank: list[list[int]]) -> tuple[list[float], list[float]]:
    """One process, all experts: each step's loss is the mean over ranks and micro-batches, as the strategy's."""
    model = _build(name)
    opt = model.configure_optimizers()
    opt = opt["optimizer"] if isinstance(opt, dict) else opt
    data, size = Tokens().data, BATCH // MICRO
    losses, norms = [], []
    for step in range(STEPS):
        parts = [seen[step * BATCH + m * size : step * BATCH + (m + 1) * size] for seen in seen_per_rank
                 for m in range(MICRO)]  # fmt: skip
        opt.zero_grad()
        loss = torch.stack([model.training_step(data[p], 0) for p in parts]).mean()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        losses.append(float(loss.detach()))
        opt.step()
    return losses, norms


@pytest.mark.parametrize("name,shard", CASES)
def test_sharded_training_follows_single_process_losses_and_norms(results, name, shard):
    runs = [r[(name, shard, True)] for r in results]
    ref_losses, ref_norms = _reference(name, [run["seen"] for run in runs])
    losses = [sum(run["losses"][s] for run in runs) / WORLD for s in range(STEPS)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for run in runs:  # the norm is global: the same on every rank, and the unsharded model's
        torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6)
    assert len(set(ref_losses)) == STEPS and ref_norms[0] > CLIP  # the steps change the model; clipping acts
    assert all(run["validated"] == (name == "moegpt") for run in runs)


@pytest.mark.parametrize("name,shard", CASES)
def test_sharded_overlap_is_bitwise_equal_to_sequential(results, name, shard):
    for rank_results in results:
        sequential = rank_results[(name, shard, False)]
        overlapped = [rank_results[(name, shard, True)]]
        if (name, shard) == ("moegpt", "full"):  # and with the expert weight gradients delayed
            overlapped.append(rank_results[(name, shard, "delay_wgrad")])
        for run in overlapped:
            assert run["losses"] == sequential["losses"]
            for a, b in zip(run["shards"], sequential["shards"], strict=True):
                assert torch.equal(a, b)


@pytest.mark.parametrize("name,shard", CASES)
def test_parameters_are_sharded_dtensors(results, name, shard):
    for rank_results in results:
        run = rank_results[(name, shard, True)]
        for layout, is_expert in zip(run["optimizer"], run["is_expert"], strict=True):
            kind, placements, mesh_shape, local, full = layout
            assert kind == "dtensor", layout
            if is_expert:  # (edp, ep): dim 0 split over both, E / (edp * ep) experts per rank
                assert mesh_shape == (WORLD // EP, EP) and placements == ("_S(0, 2)", "S(0)"), layout
                assert local[0] * WORLD == full[0] and local[1:] == full[1:], layout
            else:  # dp_cp: dim 0 split in 4 (torch.chunk: the last ranks may hold fewer rows, or none)
                assert mesh_shape == (WORLD,) and placements == ("S(0)",), layout
                assert local[0] <= -(-full[0] // WORLD) and local[1:] == full[1:], layout
        if shard == "full":  # at rest the module holds the shards themselves
            assert run["module"] == run["optimizer"]
            continue
        for layout, is_expert in zip(run["module"], run["is_expert"], strict=True):  # "optimizer": gathered at rest
            kind, placements, mesh_shape, local, full = layout
            if is_expert:  # the experts as expert parallelism holds them: E / ep per rank
                assert (kind, placements, mesh_shape) == ("dtensor", ("S(0)",), (EP,)), layout
                assert local[0] * EP == full[0], layout
            else:
                assert kind == "tensor" and local == full, layout


def test_bf16_runs_with_sharding(results):
    for rank_results in results:
        for precision in ("bf16-true", "bf16-mixed", "fsdp_mp_policy"):
            run = rank_results[("moegpt", precision)]
            losses = run["losses"]
            assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses))), (precision, losses)
            dtypes = {shard.dtype for shard in run["shards"]}  # bf16-true: bf16 parameters; else fp32 shards
            assert dtypes == {torch.bfloat16 if precision == "bf16-true" else torch.float32}, (precision, dtypes)


def test_memory_benchmark_measures_the_formula(results):
    for rank_results in results:
        rows = {row.mode: row for row in rank_results["memory"]}
        assert list(rows) == list(sharding_memory.MODES)
        for mode, row in rows.items():  # measured from the tensors held; the formula from the unsharded shapes
            assert abs(row.total / row.formula_total - 1) < 0.10, (mode, row)
        assert rows["full"].total < rows["optimizer"].total < rows["none"].total
    print(sharding_memory.table(results[0]["memory"]))


def test_sharded_checkpoint_resumes_bitwise_and_reshards_to_other_ep_and_modes(results):
    for rank_results in results:
        runs = rank_results["resumes"]
        full = runs["full_ep2"]
        done = int(RESUMED_FROM.split("step=")[1].split(".")[0])
        assert len(full) == RESUME_EPOCHS and len(set(full)) == RESUME_EPOCHS  # the steps change the model
        assert runs["full_ep2_resumed"] == full[done:]  # the same layout: the loss curve continues bitwise
        # Another ep or mode reduces the experts' and the dense gradients in other groups, so in another order; after
        # AdamW steps (whose update divides by the root of the second moment) no single reordered-sum bound holds,
        # so the curves are held to 1e-5 relative, the bound of every cross-layout comparison here (a loss of about
        # 4 and an absolute 1e-6 would be 2 float32 ulps: a bound fitted to one machine's kernels).
        torch.testing.assert_close(torch.tensor(runs["full_ep4"]), torch.tensor(full), rtol=1e-5, atol=0)
        for other in ("optimizer_ep4", "none_ep1"):  # other ep, other mode: DCP reshards experts and optimizer
            torch.testing.assert_close(torch.tensor(runs[other]), torch.tensor(full[done:]), rtol=1e-5, atol=0,
                                       msg=lambda m, o=other: f"{o}: {runs[o]} vs {full[done:]}: {m}")
