"""Sharded checkpoints written while training goes on: DCP's ``async_save``, at most one save in flight.

A background save does on the calling thread what must see the live state: the collective steps that name the
checkpoint (its path, its staging name, the merged optimizer groups), and the staging of every tensor this rank
writes into host memory (copies; pinned on CUDA), by DCP's ``async_save``. Training then goes on while a thread
writes the copies: DCP's plan and commit collectives run on a process group of their own (gloo, created once per
run), so they never pair with the training step's collectives. When DCP's save has returned on the coordinator,
every rank's files are on disk (DCP gathers the ranks' write results before it writes ``.metadata``); the
coordinator's thread then writes ``meta.pt`` and the commit marker and renames the staging directory to its name,
as a synchronous save does (:mod:`.atomic`).

At most one save is in flight: the next save, a load, a removal and the end of the run wait for it (and raise its
error, if it failed). A run that stops on a signal lets the save in flight finish, commits it, then stops; one that
is killed harder leaves a ``.partial-`` staging entry that no loader accepts and ``ckpt_path="last"`` never names.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from lightning_moe_overlap.checkpoint.sharded import META_FILE, single_process_quiet


@dataclass(frozen=True)
class Commit:
    """What the coordinator does once every rank's files of a background save are written.

    ``meta``: ``meta.pt``'s bytes (serialised on the calling thread, so later steps cannot change them);
    ``finish``: writes the marker and publishes the staging directory under its name."""

    staging: Path
    meta: bytes
    finish: Callable[[], None]


def serialise(meta: dict[str, Any]) -> bytes:
    """``meta.pt``'s content as bytes, taken now (the loops' and callbacks' state of this moment)."""
    buffer = io.BytesIO()
    torch.save(meta, buffer)
    return buffer.getvalue()


class BackgroundSaves:
    """This run's background checkpoint saves: at most one in flight.

    Attributes:
        in_flight: a save was started and not yet waited for.
    """

    def __init__(self, timeout: timedelta) -> None:
        self._timeout = timeout
        self._group: dist.ProcessGroup | None = None
        self._executor: ThreadPoolExecutor | None = None  # one thread per save, ended by `wait`
        self._job: Future[None] | None = None

    @property
    def in_flight(self) -> bool:
        return self._job is not None

    def start(self, state: dict[str, Any], staging: Path, commit: Commit | None) -> None:
        """Stage ``state`` (this rank's part of the DCP state) to host memory and write it into ``staging`` in the
        background; ``commit``: the coordinator's, ``None`` on the other ranks. Collective: every rank calls it,
        after :meth:`wait`."""
        if self._job is not None:
            raise RuntimeError("`MoEOverlapStrategy`: a background save is in flight; wait for it first.")
        distributed = dist.is_available() and dist.is_initialized()
        if distributed and self._group is None:  # every rank reaches its first background save together
            self._group = dist.new_group(backend="gloo", timeout=self._timeout)
        stager = DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
                                              use_async_staging=False, use_non_blocking_copy=False))  # fmt: skip
        with single_process_quiet():
            written = dcp.async_save(state, checkpoint_id=staging, process_group=self._group, async_stager=stager,
                                     no_dist=not distributed)  # fmt: skip
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-overlap-checkpoint")
        self._job = self._executor.submit(_finish, written, commit)

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and committed.

        Raises:
            RuntimeError: the background save failed (the cause chained); its staging entry is left, never loaded.
        """
        job, self._job = self._job, None
        if job is None:
            return
        executor, self._executor = self._executor, None
        try:
            job.result()
        except (Exception, dcp.CheckpointException) as err:  # DCP's error of a rank's write is a BaseException
            raise RuntimeError(
                f"`MoEOverlapStrategy`: a background checkpoint save failed ({_cause(err)}). Its "
                "staging entry was not committed, so no loader reads it; the previous checkpoint is intact. Fix the "
                "cause (disk space, permissions) or save synchronously (`async_save=False`)."
            ) from err
        finally:
            if executor is not None:
                executor.shutdown(wait=True)  # its one job is done: no thread outlives the save

    def close(self) -> None:
        """Wait for the save in flight, then release the save's process group."""
        try:
            self.wait()
        finally:
            if self._group is not None and dist.is_available() and dist.is_initialized():
                dist.destroy_process_group(self._group)
            self._group = None


def _cause(err: BaseException) -> str:
    """The error in one line: DCP's ``CheckpointException`` carries each rank's traceback; its last line is the
    error itself (the whole of it stays chained)."""
    lines = [line for line in str(err).splitlines() if line.strip()]
    return lines[-1] if isinstance(err, dcp.CheckpointException) and lines else f"{type(err).__name__}: {err}"


def _finish(written: Future[Any], commit: Commit | None) -> None:
    """The thread's job: DCP's write of every rank (collective on the save's group), then the coordinator's commit."""
    written.result()
    if commit is None:
        return
    with open(commit.staging / META_FILE, "wb") as f:
        f.write(commit.meta)
        f.flush()
        os.fsync(f.fileno())
    commit.finish()


__all__ = ["BackgroundSaves", "Commit", "serialise"]
