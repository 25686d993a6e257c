"""The micro-batch loop inside Lightning: hooks, logging, schedulers, validation, precision, and its clear errors.

One spawn of 2 gloo ranks (ep=2) runs every scenario; each returns what it observed and the tests assert on it.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo import MoEGPT, _PatternTokens
from tests.helpers.distributed import run_distributed

WORLD, STEPS, MICRO, BATCH = 2, 3, 2, 4


class Probe(MoEGPT):
    """The demo model plus probes; the computation is the demo's."""

    def __init__(self, batch_size: int = BATCH, manual: bool = False) -> None:
        super().__init__(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_experts=4, top_k=2,
                         ffn_hidden_size=32, lr=1e-2)
        self.batch_size = batch_size
        self.automatic_optimization = not manual
        self.calls = {"on_before_backward": 0, "on_after_backward": 0, "on_before_optimizer_step": 0}
        self.autocast: list[bool] = []
        self.mb_values: list[float] = []

    def training_step(self, batch, batch_idx):
        self.autocast.append(torch.is_autocast_enabled("cpu"))
        value = float(batch.float().mean())
        self.mb_values.append(value)
        self.log("mb_value", value)
        return super().training_step(batch, batch_idx)

    def on_before_backward(self, loss):
        self.calls["on_before_backward"] += 1

    def on_after_backward(self):
        self.calls["on_after_backward"] += 1

    def on_before_optimizer_step(self, optimizer):
        self.calls["on_before_optimizer_step"] += 1

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(_PatternTokens(64, 8, 64, seed=0), batch_size=self.batch_size, drop_last=True)

    def val_dataloader(self):
        return DataLoader(_PatternTokens(16, 8, 64, seed=1), batch_size=BATCH, drop_last=True)


class StepMetrics(Callback):
    def __init__(self) -> None:
        self.logged: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.logged.append(float(trainer.callback_metrics["mb_value"]))


def _trainer(precision: str = "32-true", **kwargs) -> Trainer:
    defaults = dict(
        accelerator="cpu", devices=WORLD, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, precision=precision, limit_val_batches=2,
        val_check_interval=STEPS, num_sanity_val_steps=0,
        strategy=MoEOverlapStrategy(ep=2, num_microbatches=MICRO, delay_wgrad=True),
    )
    return Trainer(**{**defaults, **kwargs})


def _fit(precision: str) -> dict:
    model, metrics = Probe(), StepMetrics()
    trainer = _trainer(precision, callbacks=[metrics])
    trainer.fit(model)
    return {
        "calls": model.calls, "autocast": model.autocast, "mb_values": model.mb_values, "logged": metrics.logged,
        "global_step": trainer.global_step, "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "val_loss": float(trainer.callback_metrics["val_loss"]),
    }


def _error(build) -> str:
    try:
        build()
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        return f"{type(err).__name__}: {err}"
    return "no error"


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    return {
        "fp32": _fit("32-true"),
        "bf16_mixed": _fit("bf16-mixed"),
        "bf16_true": _fit("bf16-true"),
        "uneven": _error(lambda: _trainer().fit(Probe(batch_size=3))),
        "manual": _error(lambda: _trainer().fit(Probe(manual=True))),
    }


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_worker, WORLD, timeout_s=120)


def test_loop_runs_lightning_hooks_per_microbatch_and_per_step(results):
    for r in results:
        run = r["fp32"]
        assert run["global_step"] == STEPS
        assert run["calls"] == {
            "on_before_backward": STEPS * MICRO, "on_after_backward": STEPS * MICRO, "on_before_optimizer_step": STEPS,
        }
        assert run["lr"] == pytest.approx(0.5**STEPS)  # the LR scheduler stepped once per optimizer step
        assert run["val_loss"] > 0  # validation ran (full batches, no schedule) and logged with sync_dist


def test_loop_logs_the_mean_over_microbatches(results):
    for r in results:
        run = r["fp32"]
        values = run["mb_values"]
        expected = [sum(values[s * MICRO : (s + 1) * MICRO]) / MICRO for s in range(STEPS)]
        assert run["logged"] == pytest.approx(expected, rel=1e-6)
        assert len(values) == STEPS * MICRO


@pytest.mark.parametrize("precision,autocast", [("32-true", False), ("bf16-mixed", True), ("bf16-true", False)])
def test_loop_precision_applies_in_every_context(results, precision, autocast):
    key = {"32-true": "fp32", "bf16-mixed": "bf16_mixed", "bf16-true": "bf16_true"}[precision]
    for r in results:
        run = r[key]
        assert run["global_step"] == STEPS
        assert run["autocast"] == [autocast] * (STEPS * MICRO)  # forwards run in the engine's forward context


def test_loop_clear_errors(results):
    for r in results:
        # refused from the loader before the first step (a short last batch alone would be accepted)
        assert "the training dataloader's batch_size=3 does not split into `num_microbatches=2`" in r["uneven"]
        assert r["manual"].startswith("NotImplementedError") and "manual optimization" in r["manual"]
