"""``MoEOverlapStrategy(optimizer_cpu_offload=True)`` on 2 gloo ranks (ep=2, dp=2), ``MoEGPT``, AdamW, clipping by the
global norm, 2 micro-batches.

Oracles, all from one spawn: the same run without the offload. With ``optimizer_offload_fraction`` 0.5 and 1.0 the
parameters after the steps are bitwise equal to it (on CPU the host and the device update run the same kernels on
the same dtype), with ``shard`` none, optimizer and full (the host copy of each ``DTensor`` parameter a ``DTensor``
of its placements and shape); the state a run holds splits between the device side and the host side by the
fraction (counted by the side that holds it: on CPU both sides are host memory); a run saved after each epoch and
resumed mid-way ends bitwise where the uninterrupted run ends, also resumed at fraction 0.5 from a checkpoint
written at 1.0, and without the offload from it; ``validate`` after ``fit`` gives the validation loss of the run
without the offload.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.optim import OffloadedOptimizer, state_bytes
from tests.helpers.data import RandomTokens
from tests.helpers.distributed import run_distributed

WORLD, EP, STEPS, BATCH, MICRO, CLIP, VOCAB = 2, 2, 3, 4, 2, 0.05, 64
EPOCHS, RESUMED_FROM = 4, "epoch=1-step=2.ckpt"  # one step per epoch: Tokens(WORLD * BATCH)
FRACTIONS = (None, 0.5, 1.0)  # None: no offload
SHARDS = ("none", "optimizer", "full")


class Tokens(RandomTokens):
    def __init__(self, n: int = 32, seq: int = 8) -> None:
        super().__init__(n, seq, VOCAB, seed=5)


class Record(Callback):
    """Per step: the loss and whether the clip acted; at the end, the optimizer's parameters and state bytes."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.norms.append(float(trainer.strategy.global_grad_norm()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module) -> None:
        optimizer = trainer.optimizers[0]
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self.params = [(p.to_local() if isinstance(p, DTensor) else p).detach().clone() for p in params]
        self.bytes = state_bytes(optimizer)
        inner = getattr(optimizer, "optimizer", optimizer)
        self.wrapped = isinstance(inner, OffloadedOptimizer)
        copies = inner.copies.values() if self.wrapped else []  # a DTensor's host copy: a DTensor of its layout
        self.masters = [(type(c.master), c.master.placements, c.master.shape) for c in copies]
        self.expected_masters = [(DTensor, c.param.placements, c.param.shape) for c in copies]
        self.state_devices = sorted({str(v.device) for s in optimizer.state.values() for v in s.values()})


def _model() -> MoEGPT:
    torch.manual_seed(0)
    model = MoEGPT(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_experts=4, top_k=2,
                   ffn_hidden_size=16, aux_loss_coeff=0.0, lr=1e-2)  # fmt: skip
    model.val_dataloader = lambda: DataLoader(Tokens().data[:8], batch_size=BATCH)
    return model


def _strategy(shard: str, fraction: float | None) -> MoEOverlapStrategy:
    offload = {} if fraction is None else {"optimizer_cpu_offload": True, "optimizer_offload_fraction": fraction}
    return MoEOverlapStrategy(ep=EP, num_microbatches=MICRO, shard=shard, **offload)


def _fit(shard: str, fraction: float | None) -> dict:
    model, record = _model(), Record()
    model.train_dataloader = lambda: DataLoader(Tokens(), batch_size=BATCH)
    trainer = Trainer(
        accelerator="cpu", devices=WORLD, max_steps=STEPS, gradient_clip_val=CLIP, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1,
        num_sanity_val_steps=0, check_val_every_n_epoch=100, callbacks=[record], strategy=_strategy(shard, fraction),
    )  # fmt: skip
    trainer.fit(model)
    validated = trainer.validate(model, verbose=False)[0]["val_loss"]  # fit -> validate on the prepared model
    return {"losses": record.losses, "norms": record.norms, "params": record.params, "bytes": record.bytes,
            "wrapped": record.wrapped, "state_devices": record.state_devices, "val_loss": validated,
            "masters": record.masters, "expected_masters": record.expected_masters}  # fmt: skip


def _resumed(root: Path, run: str, fraction: float | None, ckpt: Path | None) -> dict:
    model, record = _model(), Record()
    model.train_dataloader = lambda: DataLoader(Tokens(n=WORLD * BATCH), batch_size=BATCH)
    trainer = Trainer(
        accelerator="cpu", devices=WORLD, max_epochs=EPOCHS, gradient_clip_val=CLIP, logger=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, default_root_dir=root / run,
        callbacks=[record, ModelCheckpoint(dirpath=root / run, save_top_k=-1, every_n_epochs=1)],
        strategy=_strategy("full", fraction),
    )  # fmt: skip
    trainer.fit(model, ckpt_path=ckpt)
    return {"losses": record.losses, "params": record.params}


def _worker(rank: int, world: int, root: Path) -> dict:
    torch.set_num_threads(1)
    results: dict = {(shard, fraction): _fit(shard, fraction) for shard in SHARDS for fraction in FRACTIONS}
    saved = root / "offload_1.0" / RESUMED_FROM
    results["resumes"] = {
        "plain": _resumed(root, "plain", None, None),
        "offload_1.0": _resumed(root, "offload_1.0", 1.0, None),
        "resumed_1.0": _resumed(root, "resumed_1.0", 1.0, saved),
        "resumed_0.5": _resumed(root, "resumed_0.5", 0.5, saved),
        "resumed_plain": _resumed(root, "resumed_plain", None, saved),
    }
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_distributed(_worker, WORLD, tmp_path_factory.mktemp("offload"), timeout_s=300)


@pytest.mark.parametrize("shard", SHARDS)
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_offloaded_parameters_are_bitwise_those_of_the_plain_run(results, shard, fraction):
    for rank_results in results:
        plain, offloaded = rank_results[(shard, None)], rank_results[(shard, fraction)]
        assert offloaded["wrapped"] and not plain["wrapped"]
        assert offloaded["masters"] == offloaded["expected_masters"] and offloaded["masters"]
        assert offloaded["losses"] == plain["losses"] and len(set(plain["losses"])) == STEPS
        assert all(norm > CLIP for norm in plain["norms"])  # the clip acted on every step
        assert offloaded["norms"] == plain["norms"]
        for a, b in zip(offloaded["params"], plain["params"], strict=True):
            assert torch.equal(a, b)
        assert offloaded["val_loss"] == plain["val_loss"]


@pytest.mark.parametrize("shard", SHARDS)
def test_state_splits_between_device_and_host_by_the_fraction(results, shard):
    for rank_results in results:
        plain = rank_results[(shard, None)]["bytes"]
        assert plain.host == plain.host_copies == 0 and plain.device > 0
        for fraction in (0.5, 1.0):
            held = rank_results[(shard, fraction)]["bytes"]
            assert held.device + held.host == plain.device  # the same state, split by where it lives
            assert fraction <= held.host / plain.device < fraction + 0.25, (fraction, held)
            assert held.host_copies > 0
        assert rank_results[(shard, 1.0)]["bytes"].device == 0
        assert rank_results[(shard, 0.5)]["state_devices"] == ["cpu"]  # CPU run: the "device" is the host too
    print({fraction: results[0][("full", fraction)]["bytes"] for fraction in FRACTIONS})


def test_resume_ends_where_the_uninterrupted_run_ends(results):
    for rank_results in results:
        runs = rank_results["resumes"]
        whole = runs["offload_1.0"]
        assert whole["losses"] == runs["plain"]["losses"] and len(whole["losses"]) == EPOCHS
        for name in ("resumed_1.0", "resumed_0.5", "resumed_plain"):
            resumed = runs[name]
            assert resumed["losses"] == whole["losses"][2:], name  # epochs 2 and 3 after the checkpoint of epoch 1
            for a, b in zip(resumed["params"], whole["params"], strict=True):
                assert torch.equal(a, b), name
