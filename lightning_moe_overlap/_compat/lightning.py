"""Every private Lightning name this package uses, in one place (the supported range is pinned in pyproject)."""

from __future__ import annotations

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
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


def start_script_children(launcher: _SubprocessScriptLauncher) -> None:
    """Start the other local ranks (``_SubprocessScriptLauncher._call_children_scripts``; fills ``launcher.procs``)."""
    launcher._call_children_scripts()


def should_update_logs(trainer: object) -> bool:
    """Whether Lightning sends this training step's logged values to the loggers (``log_every_n_steps``)."""
    connector = trainer._logger_connector  # type: ignore[attr-defined]
    return bool(connector.should_update_logs or trainer.fast_dev_run)  # type: ignore[attr-defined]


__all__ = [
    "_MultiProcessingLauncher",
    "_SubprocessScriptLauncher",
    "_distributed_is_initialized",
    "_get_default_process_group_backend_for_device",
    "_init_dist_connection",
    "_optimizers_to_device",
    "_set_num_threads_if_needed",
    "_sync_ddp_if_available",
    "default_pg_timeout",
    "reset_seed",
    "start_script_children",
    "should_update_logs",
    "trainer_call",
]
