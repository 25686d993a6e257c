"""The private Lightning names of ``_compat/lightning.py`` still exist and behave.

A failure here names ``lightning.__version__`` and the private name: update ``_compat/lightning.py`` (and only it).
"""

from __future__ import annotations

import csv
import inspect
import os
from datetime import timedelta
from types import SimpleNamespace

import lightning
import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import StrategyRegistry as PublicStrategyRegistry

from lightning_moe_overlap._compat import lightning as pl_compat

VERSION = f"lightning {lightning.__version__}"


def _fail(name: str, what: str) -> str:
    return f"{VERSION}: `{name}` {what}; update `lightning_moe_overlap/_compat/lightning.py`"


def _parameters(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_every_exported_name_is_tested() -> None:
    assert set(pl_compat.__all__) == TESTED, _fail("__all__", "changed without a test for each name")


def test_process_group_helpers() -> None:
    from lightning.fabric.utilities import distributed

    for name, params in {
        "_distributed_is_initialized": [],
        "_get_default_process_group_backend_for_device": ["device"],
        "_init_dist_connection": ["cluster_environment", "torch_distributed_backend", "global_rank", "world_size"],
        "_sync_ddp_if_available": ["result", "group", "reduce_op"],
        "_set_num_threads_if_needed": ["num_processes"],
    }.items():
        fn = getattr(distributed, name, None)
        assert fn is not None, _fail(f"lightning.fabric.utilities.distributed.{name}", "is gone")
        assert _parameters(fn)[: len(params)] == params, _fail(name, f"takes {_parameters(fn)}, not {params}")
    assert pl_compat.distributed_is_initialized() is False  # unit tests run without a process group
    assert pl_compat.default_process_group_backend(torch.device("cpu")) == "gloo"
    tensor = torch.tensor([2.0])
    assert pl_compat.sync_ddp_if_available(tensor, None, reduce_op="mean") is tensor  # no group: unchanged
    assert isinstance(pl_compat.default_pg_timeout, timedelta)


def test_init_dist_connection_forwards_its_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}
    monkeypatch.setattr(pl_compat, "_init_dist_connection", lambda *args, **kwargs: seen.update(a=args, k=kwargs))
    pl_compat.init_dist_connection("env", "gloo", timeout=timedelta(seconds=3), device_id=None)
    assert seen == {"a": ("env", "gloo"), "k": {"timeout": timedelta(seconds=3), "device_id": None}}


def test_set_num_threads_if_needed_respects_omp_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    pl_compat.set_num_threads_if_needed(num_processes=2)
    assert torch.get_num_threads() == threads and os.environ["OMP_NUM_THREADS"] == "1"


def test_optimizers_to_device_moves_state() -> None:
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([param])
    param.grad = torch.ones(2)
    opt.step()
    pl_compat.optimizers_to_device([opt], torch.device("cpu"))
    assert opt.state[param]["exp_avg"].device.type == "cpu"


def test_reset_seed_and_trainer_call() -> None:
    assert _parameters(pl_compat.reset_seed) == [], _fail("reset_seed", "takes arguments")
    for name in ("_call_lightning_module_hook", "_call_callback_hooks", "_call_strategy_hook"):
        assert hasattr(pl_compat.trainer_call, name), _fail(f"lightning.pytorch.trainer.call.{name}", "is gone")


def test_strategy_registry_is_the_public_registrys_type() -> None:
    assert isinstance(PublicStrategyRegistry, pl_compat.StrategyRegistry), _fail("_StrategyRegistry", "changed")


def test_launchers() -> None:
    launcher = pl_compat.SubprocessScriptLauncher
    assert callable(getattr(launcher, "_call_children_scripts", None)), _fail(
        "_SubprocessScriptLauncher._call_children_scripts", "is gone"
    )
    parent = pl_compat.MultiProcessingLauncher.__mro__[1]
    method = getattr(parent, "_collect_rank_zero_results", None)
    assert method is not None, _fail("_MultiProcessingLauncher._collect_rank_zero_results", "is gone")
    assert _parameters(method) == ["self", "trainer", "results"], _fail(
        "_MultiProcessingLauncher._collect_rank_zero_results", f"takes {_parameters(method)}"
    )
    seen = []

    class Launcher(pl_compat.MultiProcessingLauncher):
        def collect_rank_zero_results(self, trainer, results):
            seen.append((trainer, results))
            return "collected"

    launcher_obj = Launcher("strategy-object", start_method="spawn")
    assert launcher_obj.strategy == "strategy-object", _fail("_MultiProcessingLauncher._strategy", "is gone")
    assert launcher_obj._collect_rank_zero_results("trainer", "results") == "collected"  # Lightning's call
    assert seen == [("trainer", "results")]


def test_fit_arguments_of_lightnings_fit_impl() -> None:
    params = _parameters(Trainer._fit_impl)
    expected = ["self", "model", "train_dataloaders", "val_dataloaders", "datamodule", "ckpt_path"]
    assert params[:6] == expected, _fail("Trainer._fit_impl", f"takes {params}, not {expected}")
    assert pl_compat.fit_arguments(Trainer._fit_impl, ("model", None, None, "dm", "last")) == ("model", "dm", "last")
    assert pl_compat.fit_arguments(Trainer._fit_impl, ("model",)) == ("model", None, None)
    assert pl_compat.fit_arguments(print, ("model",)) == (None, None, None)


def test_start_script_children_calls_lightnings_method() -> None:
    calls = []
    launcher = SimpleNamespace(_call_children_scripts=lambda: calls.append(1))
    pl_compat.start_script_children(launcher)  # type: ignore[arg-type]
    assert calls == [1]


def _trainer() -> Trainer:
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    model = BoringModel()
    trainer.strategy.connect(model)
    model.trainer = trainer
    return trainer


def test_skip_backward_and_zero_grad_on_lightnings_automatic_optimization() -> None:
    trainer = _trainer()
    auto = trainer.fit_loop.epoch_loop.automatic_optimization
    assert hasattr(auto, "_skip_backward"), _fail("_AutomaticOptimization._skip_backward", "is gone")
    pl_compat.set_skip_backward(trainer, True)
    assert auto._skip_backward is True and pl_compat.skips_backward(trainer)
    opt = torch.optim.SGD(trainer.lightning_module.parameters(), lr=0.1)
    skipped = auto._make_backward_fn(opt) is None and auto._make_zero_grad_fn(0, opt) is None
    assert skipped, _fail("_AutomaticOptimization._skip_backward", "no longer skips backward and zero-grad")
    pl_compat.set_skip_backward(trainer, False)
    assert not pl_compat.skips_backward(trainer)

    model = trainer.lightning_module
    param = next(model.parameters())
    param.grad = torch.ones_like(param)
    hooks = []
    model.on_before_zero_grad = lambda optimizer: hooks.append(optimizer)
    pl_compat.zero_grad(trainer, 0, opt)
    assert hooks == [opt], _fail("_AutomaticOptimization._on_before_zero_grad", "no longer calls the hook")
    zeroed = param.grad is None or not param.grad.any()
    assert zeroed, _fail("_AutomaticOptimization._optimizer_zero_grad", "kept the gradients")


def test_should_accumulate_follows_lightnings_windows() -> None:
    """``fit_loop._should_accumulate()``, read inside each training step of a run with ``accumulate_grad_batches=3``
    over 5 batches: a window of 3, then the epoch's last batches close a window of 2."""
    seen: list[bool] = []

    class Model(BoringModel):
        def training_step(self, batch, batch_idx):
            seen.append(pl_compat.should_accumulate(self.trainer))
            return super().training_step(batch, batch_idx)

    trainer = Trainer(
        accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=5, limit_val_batches=0,
        accumulate_grad_batches=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Model())
    assert seen == [True, True, False, True, False], _fail("fit_loop._should_accumulate", f"gave {seen}")


def test_attached_trainer_and_should_update_logs() -> None:
    trainer = _trainer()
    assert pl_compat.attached_trainer(trainer.lightning_module) is trainer, _fail("LightningModule._trainer", "changed")
    assert pl_compat.attached_trainer(BoringModel()) is None
    assert hasattr(trainer, "_logger_connector"), _fail("Trainer._logger_connector", "is gone")
    assert isinstance(pl_compat.should_update_logs(trainer), bool)


class _StepsAtBatchEnd(BoringModel):
    """Logs ``global_step`` at every ``on_train_batch_end`` and keeps the compat's step of that moment."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[int] = []

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.steps.append(pl_compat.logging_step(self.trainer))
        self.log("global_step_seen", float(self.trainer.global_step), on_step=True, on_epoch=False)


def test_logging_step_is_the_step_the_loggers_record(tmp_path) -> None:
    model = _StepsAtBatchEnd()
    trainer = Trainer(max_steps=3, log_every_n_steps=1, logger=CSVLogger(tmp_path, name="csv", version=0),
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0)
    trainer.fit(model)
    rows = [r for r in csv.DictReader(open(tmp_path / "csv" / "version_0" / "metrics.csv")) if r["global_step_seen"]]
    recorded = [int(r["step"]) for r in rows]  # the oracle: the step Lightning's logger wrote for each value
    assert model.steps == recorded == [0, 1, 2], _fail("fit_loop.epoch_loop._batches_that_stepped", "is not the step "
                                                       "loggers record at on_train_batch_end")
    assert [int(float(r["global_step_seen"])) for r in rows] == [1, 2, 3]  # one more: the optimizer stepped


def test_optimizer_handles_unscaling() -> None:
    params = [torch.nn.Parameter(torch.ones(2))]
    assert pl_compat.optimizer_handles_unscaling(torch.optim.SGD(params, lr=0.1)) is False
    fused = torch.optim.SGD(params, lr=0.1)
    fused._step_supports_amp_scaling = True  # what torch's fused optimizers set
    assert pl_compat.optimizer_handles_unscaling(fused) is True, _fail("_optimizer_handles_unscaling", "changed")


def test_set_device_mesh_is_what_the_public_property_returns() -> None:
    module = BoringModel()
    mesh = object()
    pl_compat.set_device_mesh(module, mesh)
    assert module.device_mesh is mesh, _fail("LightningModule._device_mesh", "is not what `device_mesh` returns")


def test_replace_sigterm_notifier_and_mark_sigterm_received() -> None:
    import signal

    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    before = signal.getsignal(signal.SIGTERM)
    connector = trainer._signal_connector
    connector.register_signal_handlers()
    try:
        called = []
        assert pl_compat.replace_sigterm_notifier(trainer, lambda s, f: called.append(s)), _fail(
            "_SignalConnector._sigterm_notifier_fn / signal_connector._HandlersCompose", "is no longer the handler"
        )
        assert not pl_compat.replace_sigterm_notifier(trainer, print)  # replaced once: Lightning's notifier is gone
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
        assert called == [signal.SIGTERM] and not trainer.received_sigterm, _fail(
            "_HandlersCompose", "no longer calls the handlers it holds"
        )
        pl_compat.mark_sigterm_received(trainer)
        assert trainer.received_sigterm, _fail("_SignalConnector.received_sigterm", "no longer backs the property")
    finally:
        connector.teardown()
        signal.signal(signal.SIGTERM, before)


TESTED = {
    "finish_saved_epoch",  # tests/unit/test_exact_resume.py
    "set_device_mesh",
    "mark_sigterm_received",
    "replace_sigterm_notifier",
    "MultiProcessingLauncher",
    "StrategyRegistry",
    "SubprocessScriptLauncher",
    "attached_trainer",
    "default_pg_timeout",
    "default_process_group_backend",
    "distributed_is_initialized",
    "fit_arguments",
    "init_dist_connection",
    "logging_step",
    "optimizer_handles_unscaling",
    "optimizers_to_device",
    "reset_seed",
    "set_num_threads_if_needed",
    "set_skip_backward",
    "should_accumulate",
    "should_update_logs",
    "skips_backward",
    "start_script_children",
    "sync_ddp_if_available",
    "trainer_call",
    "zero_grad",
}
