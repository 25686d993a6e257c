"""The launchers: ``start_method="popen"`` (re-run the script per rank) and ``"spawn"|"fork"|"forkserver"``.

The script launcher (``popen``, also every rank under ``torchrun`` or SLURM) adds, to Lightning's:

- checks that need the ``fit`` arguments (the datamodule's batch size, the checkpoint path), made before any
  process is spawned;
- no orphaned ranks: children die with the launching process, and it ends them when it fails or exits
  (``processes/lifeline.py``);
- one line per rank on failure: a rank whose error follows another rank's says which rank and why
  (``processes/exits.py``); errors that every rank finds alike are shown once, by rank 0.

The multiprocessing launcher sends rank 0's ``state_dict()`` back to the main process, whose model was never made
expert-parallel: rank 0 holds only its own experts, so the shapes would not match and the other ranks' experts
would be lost. It sends the unsharded state (every expert, gathered over the ep group) instead.

Both read the strategy that launches them through :class:`LaunchingStrategy`, the few members they use, so this
module does not import the strategy (which imports it).
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch.nn import Module

from lightning_moe_overlap._compat import lightning as pl_compat
from lightning_moe_overlap.overlap.failures import PeerFailure
from lightning_moe_overlap.processes.exits import ExitBoard
from lightning_moe_overlap.processes.lifeline import LAUNCHER_PID_ENV, ChildReaper, describe_exit, die_with_parent
from lightning_moe_overlap.validation import (
    SAME_ON_EVERY_RANK,
    Problem,
    check_launch,
    check_model,
    check_trainer,
    known_batch_size,
    raise_problems,
)
from lightning_moe_overlap.moe.model_handle import MoEModelHandle

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from lightning_moe_overlap.config import OverlapConfig
    from lightning_moe_overlap.parallel.dims import ParallelDims

PEER_LOSS_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Timed out", "timed out", "Broken pipe")
PEER_WAIT_S = 1.0  # how long an error that looks like a lost peer waits for that peer's report


class LaunchingStrategy(Protocol):
    """What the launchers read from the strategy that launches them (``MoEOverlapStrategy``)."""

    @property
    def config(self) -> OverlapConfig: ...

    @property
    def dims(self) -> ParallelDims: ...

    @property
    def global_rank(self) -> int: ...

    def full_state_dict(self) -> dict[str, Any] | None: ...


class ExpertParallelScriptLauncher(pl_compat.SubprocessScriptLauncher):
    """Lightning's script launcher, with pre-spawn checks, no orphans, and failures attributed.

    Args:
        strategy: the strategy that launches (read for its settings and ranks).
        failure_grace_s: after a failure, how long the launching process waits for its children to end by
            themselves (each reporting why) before it sends SIGTERM, then SIGKILL.
        exit_grace_s: the same wait when the launching process exits normally.
    """

    def __init__(
        self,
        strategy: LaunchingStrategy,
        cluster_environment: Any,
        num_processes: int,
        num_nodes: int,
        *,
        failure_grace_s: float = 10.0,
        exit_grace_s: float = 60.0,
    ) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.strategy = strategy
        self.failure_grace_s = failure_grace_s
        self.exit_grace_s = exit_grace_s
        self._reaper: ChildReaper | None = None
        self._child = False  # this process is a rank that the launching process started

    def launch(self, function: Callable, *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
        raise_problems(self._prespawn_problems(function, args, trainer))
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        launcher_pid = os.environ.get(LAUNCHER_PID_ENV)
        if not self.cluster_environment.creates_processes_externally:
            self._start_children()
        elif launcher_pid is not None:
            self._child = True
            die_with_parent(int(launcher_pid))
        pl_compat.set_num_threads_if_needed(self.num_processes)
        try:
            return function(*args, **kwargs)
        except BaseException as err:
            raise self._failed(err)  # noqa: B904 - `_failed` returns `err` itself or a short PeerFailure

    def _prespawn_problems(self, function: Callable, args: tuple, trainer: Trainer | None) -> list[Problem]:
        """What can be known before spawning: fit's arguments, the trainer's settings, and the experts a model
        builds in ``__init__`` (errors only: a model may build its experts in ``configure_model``, after spawning)."""
        model, datamodule, ckpt_path = pl_compat.fit_arguments(function, args)
        config = self.strategy.config
        problems = check_launch(config, known_batch_size(datamodule), ckpt_path)
        if isinstance(model, LightningModule) and trainer is not None:
            problems += check_trainer(config, automatic_optimization=model.automatic_optimization)
        if isinstance(model, Module) and not problems:
            dims = self.strategy.dims
            experts = MoEModelHandle(model).experts_per_block()
            problems = [p for p in check_model(config, experts, dims.ep_span) if p.is_error]
        return problems

    # -- children ------------------------------------------------------------------------------------------------
    def _start_children(self) -> None:
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # copied into the children's environment only
        try:
            pl_compat.start_script_children(self)
        finally:
            del os.environ[LAUNCHER_PID_ENV]
        self._reaper = ChildReaper(self.procs, self._child_ended).start()
        atexit.register(self._reaper.reap, self.exit_grace_s)

    def _child_ended(self, local_rank: int, returncode: int) -> None:
        rank = self.cluster_environment.node_rank() * self.num_processes + local_rank
        why = describe_exit(returncode)
        board = ExitBoard.for_default_group()
        if board is not None:
            board.post(rank, why)

    # -- failures ------------------------------------------------------------------------------------------------
    def _failed(self, err: BaseException) -> BaseException:
        rank = self.strategy.global_rank
        board = ExitBoard.for_default_group()
        line: str | None = None
        own = _own_error(err)
        if own is not None:  # another rank failed first, and this rank met an error of its own as well
            if board is not None:
                board.post_failure(own)
            peer = str(err).split(". Its traceback", 1)[0]
            if self._child:
                line = f"[rank {rank}] {peer}. This rank's own error: {_one_line(own)}"
            else:  # this process's own error, whole, with what the other rank did as a note
                own.add_note(f"[rank {rank}] {peer}; its traceback is in that rank's output.")
                own.__suppress_context__ = True
                err = own
        elif isinstance(err, PeerFailure):
            line = str(err)
        elif getattr(err, SAME_ON_EVERY_RANK, False):
            if rank != 0:
                line = f"[rank {rank}] stopped by the configuration error every rank found (rank 0 shows it)."
                if board is not None:  # should rank 0 not find it after all, it stops saying this rank's error
                    board.post_failure(err)
        elif board is not None and isinstance(err, Exception):
            # only a lost peer makes this rank's error another rank's consequence; any other error is its own
            peer = board.first_peer(wait_s=PEER_WAIT_S) if _looks_like_peer_loss(err) else None
            if peer is not None:
                line = f"[rank {rank}] stopped because {peer}. This rank's own error: {_one_line(err)}"
            else:
                board.post_failure(err)
                if self._child and rank != 0 and board.report(0, wait_s=PEER_WAIT_S) == board.failure_text(err):
                    line = f"[rank {rank}] stopped by the same error as rank 0 (rank 0 shows it): {_one_line(err)}"
        if self._reaper is not None:
            self._release_children(board)
        if line is None:
            return err
        if self._child:  # one line instead of a traceback that repeats another rank's
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
            return SystemExit(1)
        if isinstance(err, PeerFailure) or getattr(err, SAME_ON_EVERY_RANK, False):
            return err  # already says it all; ranks of other launchers (torchrun, SLURM) raise it as it is
        failure = PeerFailure(line)
        failure.__suppress_context__ = True
        return failure

    def _release_children(self, board: ExitBoard | None) -> None:
        """Unblock the children (their collectives with this rank fail at once), then end those still running.

        The store stays alive (``board`` holds it) while the children read the reports."""
        assert self._reaper is not None
        if board is not None and dist.is_initialized():
            dist.destroy_process_group()
        ended = self._reaper.reap(self.failure_grace_s)
        if ended:
            node_offset = self.cluster_environment.node_rank() * self.num_processes
            listed = ", ".join(f"rank {node_offset + r} ({sig})" for r, sig in sorted(ended.items()))
            sys.stderr.write(
                f"[rank {self.strategy.global_rank}] ended {listed}: still running {self.failure_grace_s:g} s "
                "after the failure (the last signal sent is named).\n"
            )


def _own_error(err: BaseException) -> Exception | None:
    """The error of this rank's own behind a :class:`PeerFailure` (its cause), unless that error is only the sign of
    the lost peer (a failed collective); None otherwise."""
    own = err.__cause__ if isinstance(err, PeerFailure) else None
    if isinstance(own, Exception) and not isinstance(own, PeerFailure) and not _looks_like_peer_loss(own):
        return own
    return None


def _looks_like_peer_loss(err: BaseException) -> bool:
    """A failed collective or store access (the usual sign that another rank ended), not an error of this rank."""
    return isinstance(err, dist.DistError) or any(marker in str(err) for marker in PEER_LOSS_MARKERS)


def _one_line(err: BaseException, limit: int = 160) -> str:
    text = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ExpertParallelSpawnLauncher(pl_compat.MultiProcessingLauncher):
    """Lightning's multiprocessing launcher; the weights it sends back to the main process are the unsharded ones."""

    def collect_rank_zero_results(self, trainer: Trainer, results: Any) -> Any:
        """Lightning saves ``trainer.lightning_module.state_dict()`` on rank 0 for the main process to load; a
        ``state_dict`` post-hook (torch's supported way to change what ``state_dict()`` returns) makes it the
        unsharded state for that one call."""
        full = self.strategy.full_state_dict()  # collective: every rank takes part, rank 0 receives
        handle = trainer.lightning_module.register_state_dict_post_hook(_replace_with(full or {}))
        try:
            return super().collect_rank_zero_results(trainer, results)
        finally:
            handle.remove()


def _replace_with(state: dict[str, Any]) -> Callable[..., None]:
    """A ``state_dict`` post-hook that replaces the module's state, in place, with ``state``."""

    def hook(module: Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        state_dict.clear()
        state_dict.update(state)

    return hook
