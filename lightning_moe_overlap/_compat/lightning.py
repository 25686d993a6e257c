"""Every private Lightning name this package uses, in one place (the supported range is pinned in pyproject).

The rest of the package reaches them only through the public names below; each function's docstring names the
private attribute it stands for, and ``tests/unit/test_compat_lightning.py`` fails naming ``lightning.__version__``
when Lightning renames or changes one.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _set_num_threads_if_needed,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer import call as trainer_call
from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose
from torch import Tensor

StrategyRegistry = _StrategyRegistry  # ``lightning.fabric.strategies._StrategyRegistry`` (type of the registry)
SubprocessScriptLauncher = _SubprocessScriptLauncher  # ``lightning.pytorch.strategies.launchers`` (popen launcher)


# -- signals ------------------------------------------------------------------------------------------------------
def replace_sigterm_notifier(trainer: Any, handler: Any) -> bool:
    """In the SIGTERM handler Lightning installed for this run (a ``signal_connector._HandlersCompose``), put
    ``handler`` in place of the trainer's ``_SignalConnector._sigterm_notifier_fn``, the other handlers kept in their
    order. False (nothing changed) where the handler is not Lightning's (not in the main thread, on Windows, or
    already replaced)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGTERM"):
        return False
    current = signal.getsignal(signal.SIGTERM)
    notifier = trainer._signal_connector._sigterm_notifier_fn
    if not isinstance(current, _HandlersCompose) or notifier not in current.signal_handlers:
        return False
    handlers = [handler if h == notifier else h for h in current.signal_handlers]
    signal.signal(signal.SIGTERM, _HandlersCompose(handlers))
    return True


def mark_sigterm_received(trainer: Any) -> None:
    """``trainer._signal_connector.received_sigterm = True``: what ``trainer.received_sigterm`` reads."""
    trainer._signal_connector.received_sigterm = True


# -- the loops' saved progress --------------------------------------------------------------------------------------
_COUNTERS = ("ready", "started", "processed", "completed")


def finish_saved_epoch(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` with its fit loop's progress closed where it was saved at the end of an epoch (a copy), else
    ``checkpoint`` itself.

    Lightning 2.6's ``_FitLoop`` increments ``epoch_progress``'s ``processed`` before the epoch-end hooks (where
    ``ModelCheckpoint(every_n_epochs=...)`` saves) and ``completed`` after them. Restored with ``max_steps`` set
    (``_FitLoop._iteration_based_training`` forces ``restarting``), that state re-enters the finished epoch: one
    step on the next epoch's first batch labelled as the old epoch, then that batch again, a step short at the end.
    The saved state that says so: the epoch's counters ``ready == started == processed == completed + 1`` and the
    epoch loop's batch counters all equal. The copy has the epoch completed and the epoch loop's per-epoch
    (``current``) counters at zero, as ``_TrainingEpochLoop.reset`` leaves them at the start of an epoch, and its
    validation loop's batch progress reset as each epoch's start resets it: the next epoch starts at its first batch
    with or without ``max_steps``. Keys: ``loops.fit_loop`` (``epoch_progress``, ``epoch_loop.batch_progress``,
    ``epoch_loop.scheduler_progress``, ``epoch_loop.automatic_optimization.optim_progress``,
    ``epoch_loop.manual_optimization.optim_step_progress``, ``epoch_loop.val_loop.batch_progress``)."""
    loop = checkpoint.get("loops", {}).get("fit_loop")
    if not isinstance(loop, dict) or "epoch_progress" not in loop or "epoch_loop.batch_progress" not in loop:
        return checkpoint
    epochs, batches = loop["epoch_progress"], loop["epoch_loop.batch_progress"]
    try:
        ended = all(
            epochs[t]["ready"] == epochs[t]["started"] == epochs[t]["processed"] == epochs[t]["completed"] + 1
            and len({batches[t][k] for k in _COUNTERS}) == 1
            for t in ("total", "current")
        )
    except (KeyError, TypeError):  # another Lightning's layout: left as it is
        return checkpoint
    if not ended:
        return checkpoint
    loop = copy.deepcopy(loop)
    for t in ("total", "current"):
        loop["epoch_progress"][t]["completed"] = loop["epoch_progress"][t]["processed"]
    loop["epoch_loop.batch_progress"]["is_last_batch"] = False
    optimizer = loop.get("epoch_loop.automatic_optimization.optim_progress", {}).get("optimizer", {})
    for progress in (loop["epoch_loop.batch_progress"], loop.get("epoch_loop.scheduler_progress"),
                     optimizer.get("step"), optimizer.get("zero_grad"),
                     loop.get("epoch_loop.manual_optimization.optim_step_progress")):  # fmt: skip
        if isinstance(progress, dict) and isinstance(progress.get("current"), dict):
            progress["current"] = dict.fromkeys(progress["current"], 0)
    validation = loop.get("epoch_loop.val_loop.batch_progress")
    if isinstance(validation, dict):
        validation.update(total=dict.fromkeys(_COUNTERS, 0), current=dict.fromkeys(_COUNTERS, 0), is_last_batch=False)
    return {**checkpoint, "loops": {**checkpoint["loops"], "fit_loop": loop}}


# -- process groups ------------------------------------------------------------------------------------------------
def distributed_is_initialized() -> bool:
    """``lightning.fabric.utilities.distributed._distributed_is_initialized``: a default process group exists."""
    return _distributed_is_initialized()


def default_process_group_backend(device: torch.device) -> str:
    """``_get_default_process_group_backend_for_device``: ``"nccl"`` for CUDA, ``"gloo"`` for CPU."""
    return _get_default_process_group_backend_for_device(device)


def init_dist_connection(cluster_environment: Any, backend: str, **kwargs: Any) -> None:
    """``_init_dist_connection``: the default process group from the cluster environment (kwargs: ``timeout``,
    ``device_id``)."""
    _init_dist_connection(cluster_environment, backend, **kwargs)


def sync_ddp_if_available(tensor: Tensor, group: Any | None = None, reduce_op: Any | None = None) -> Tensor:
    """``_sync_ddp_if_available``: all-reduce ``tensor`` over ``group`` (``"mean"`` divides), as Lightning's DDP."""
    return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


def set_num_threads_if_needed(num_processes: int) -> None:
    """``_set_num_threads_if_needed``: cap torch's threads per process unless ``OMP_NUM_THREADS`` is set."""
    _set_num_threads_if_needed(num_processes=num_processes)


def optimizers_to_device(optimizers: Any, device: torch.device) -> None:
    """``lightning.fabric.utilities.optimizer._optimizers_to_device``: move the optimizers' state to ``device``."""
    _optimizers_to_device(optimizers, device)


# -- launchers -----------------------------------------------------------------------------------------------------
def start_script_children(launcher: _SubprocessScriptLauncher) -> None:
    """Start the other local ranks (``_SubprocessScriptLauncher._call_children_scripts``; fills ``launcher.procs``)."""
    launcher._call_children_scripts()


def fit_arguments(function: Any, args: tuple) -> tuple[Any, Any, Any]:
    """The model, datamodule and ckpt_path a launcher's ``function`` gets when it is ``Trainer._fit_impl(model,
    train_dataloaders, val_dataloaders, datamodule, ckpt_path, ...)``; Nones for any other function."""
    if getattr(function, "__name__", "") != "_fit_impl":
        return None, None, None
    return tuple(args[i] if len(args) > i else None for i in (0, 3, 4))  # type: ignore[return-value]


class MultiProcessingLauncher(_MultiProcessingLauncher):
    """``_MultiProcessingLauncher`` whose private ``_collect_rank_zero_results`` is overridden as
    :meth:`collect_rank_zero_results` (called on every rank when the trained function returned)."""

    @property
    def strategy(self) -> Any:
        """``_MultiProcessingLauncher._strategy``: the strategy that launches."""
        return self._strategy

    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        return self.collect_rank_zero_results(trainer, results)

    def collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        """Lightning's own: rank 0 saves ``trainer.lightning_module.state_dict()`` for the main process to load."""
        return super()._collect_rank_zero_results(trainer, results)


# -- the training loop (the ``_skip_backward`` pattern; docs/overlap.md, "The step inside Lightning") ----------------
def _automatic_optimization(trainer: Any) -> Any:
    return trainer.fit_loop.epoch_loop.automatic_optimization


def set_skip_backward(trainer: Any, skip: bool) -> None:
    """``_AutomaticOptimization._skip_backward``: when True, Lightning's closure runs ``strategy.training_step`` only
    (no zero-grad, no backward); the strategy's step does both itself."""
    _automatic_optimization(trainer)._skip_backward = skip


def skips_backward(trainer: Any) -> bool:
    """Reads ``_AutomaticOptimization._skip_backward``."""
    return bool(_automatic_optimization(trainer)._skip_backward)


def zero_grad(trainer: Any, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
    """What Lightning's closure does before a step's backward, which ``_skip_backward`` leaves to the strategy:
    ``_AutomaticOptimization._on_before_zero_grad`` (the ``on_before_zero_grad`` hooks) then
    ``_AutomaticOptimization._optimizer_zero_grad`` (``LightningModule.optimizer_zero_grad``)."""
    loop = _automatic_optimization(trainer)
    loop._on_before_zero_grad(optimizer)
    loop._optimizer_zero_grad(batch_idx, optimizer)


def should_accumulate(trainer: Any) -> bool:
    """``fit_loop._should_accumulate()``: the current training batch is not the last of its accumulation window
    (``accumulate_grad_batches``; the epoch's last batch always ends one), so no optimizer step follows it."""
    return bool(trainer.fit_loop._should_accumulate())


def attached_trainer(module: Any) -> Any | None:
    """``LightningModule._trainer``: the Trainer the module is attached to, or None (``module.trainer`` raises)."""
    return getattr(module, "_trainer", None)


def should_update_logs(trainer: object) -> bool:
    """Whether Lightning sends this training step's logged values to the loggers (``log_every_n_steps``;
    ``Trainer._logger_connector.should_update_logs``)."""
    connector = trainer._logger_connector  # type: ignore[attr-defined]
    return bool(connector.should_update_logs or trainer.fast_dev_run)  # type: ignore[attr-defined]


def logging_step(trainer: object) -> int:
    """The step at which Lightning's loggers record the values logged during the current training batch, its hooks
    included (``fit_loop.epoch_loop._batches_that_stepped``, what ``LoggerConnector.log_metrics`` passes as
    ``step``; Lightning raises it only after ``on_train_batch_end``, so it is one less than ``global_step`` there)."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)  # type: ignore[attr-defined]


# -- precision -----------------------------------------------------------------------------------------------------
def set_device_mesh(module: Any, mesh: Any) -> None:
    """``LightningModule._device_mesh``: what its public ``device_mesh`` property returns, set as Lightning's
    ``ModelParallelStrategy`` sets it, before ``configure_model``."""
    module._device_mesh = mesh


def optimizer_handles_unscaling(optimizer: Any) -> bool:
    """``lightning.fabric.plugins.precision.amp._optimizer_handles_unscaling``: the optimizer unscales gradients in
    its own ``step`` (fused optimizers), so gradients are still scaled when clipping would run."""
    return bool(_optimizer_handles_unscaling(optimizer))


__all__ = [
    "MultiProcessingLauncher",
    "StrategyRegistry",
    "SubprocessScriptLauncher",
    "attached_trainer",
    "default_pg_timeout",
    "default_process_group_backend",
    "distributed_is_initialized",
    "finish_saved_epoch",
    "fit_arguments",
    "mark_sigterm_received",
    "init_dist_connection",
    "logging_step",
    "optimizer_handles_unscaling",
    "optimizers_to_device",
    "replace_sigterm_notifier",
    "reset_seed",
    "set_device_mesh",
    "set_num_threads_if_needed",
    "set_skip_backward",
    "should_accumulate",
    "should_update_logs",
    "skips_backward",
    "start_script_children",
    "sync_ddp_if_available",
    "trainer_call",
    "zero_grad",
]
