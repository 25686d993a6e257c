"""Cross-rank failure reports: when the schedule fails on one rank, the other ranks say which rank and why.

A rank that fails leaves the others blocked in a collective that will never complete. Gloo raises a plain
``RuntimeError`` for both causes there are: "Timed out waiting ...ms for send/recv" after the process-group
timeout, and "Connection closed by peer" within milliseconds once the failed rank's process exits. Neither
names the failure, and a rank cannot tell from its own error whether it failed first. So:

- the **first** rank to fail (no other rank's report on the board yet) posts ``rank r: <type>: <message>`` to
  the default c10d store under ``<namespace>/<step>/`` and re-raises its original exception;
- every other rank raises :class:`PeerFailure` (a ``RuntimeError``) with that text, chained from its own error.

Ranks read the board while their schedule runs (the engine's supervising thread polls it every ``poll_s``):
they stop at their next hand-over instead of issuing further collectives, and they have the text in hand before
their own collective fails. That matters because the c10d store lives in one rank's process (rank 0 unless an
agent such as torchrun hosts it): if that rank is the one that failed, the store dies with it. The failed rank
therefore waits, at most ``ack_timeout_s``, until every other rank acknowledged the report before it re-raises.

On NCCL ``work.wait()`` does not block the host (it only makes the compute stream wait), so a dead peer shows up
at the next host sync, which then blocks, or as the NCCL watchdog's abort at the process-group timeout. Two
helpers make that end clean: :func:`default_nccl_error_handling` (the watchdog tears every rank down with its
message) and :func:`safety_nets` (the engine's own timeouts never fire after the watchdog).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import TypeVar

import torch.distributed as dist

from lightning_moe_overlap._compat import torch as torch_compat

T = TypeVar("T")
MAX_REPORT_CHARS = 2000
NCCL_ERROR_HANDLING_VARS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")  # new name, old name
NCCL_ERROR_HANDLING_DEFAULT = "3"  # tear the process down on a failed or timed-out collective (skip comm clean-up)
GLOO_MARGIN_S = 60.0  # on gloo the collective's own timeout error comes first; the engine's nets are behind it


def default_nccl_error_handling(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` unless it (or its old name ``NCCL_ASYNC_ERROR_HANDLING``) is set.

    Call before the NCCL process group is created (it reads the variable then). With 3, the watchdog that finds a
    collective failed or past the process-group timeout logs which one (``Watchdog caught collective operation
    timeout: WorkNCCL(SeqNum=..., OpType=ALLTOALL_BASE, ...)``) and takes the process down, so every rank ends
    with a message instead of blocking in its next host sync. Returns True when it set the variable.
    """
    environ = os.environ if environ is None else environ
    if any(name in environ for name in NCCL_ERROR_HANDLING_VARS):
        return False
    environ[NCCL_ERROR_HANDLING_VARS[0]] = NCCL_ERROR_HANDLING_DEFAULT
    return True


@dataclass(frozen=True)
class SafetyNets:
    """The engine's timeouts for one process-group timeout (see :class:`OverlapEngine`).

    Attributes:
        wait_s: how long a context waits for the baton.
        stall_s: how long a phase may go without a hand-over.
    """

    wait_s: float
    stall_s: float


def safety_nets(pg_timeout_s: float, backend: str) -> SafetyNets:
    """The engine's timeouts for a process group with ``pg_timeout_s`` on ``backend``.

    - gloo: ``work.wait()`` blocks and raises at the process-group timeout with gloo's own message, so the
      engine's nets sit behind it (``+ GLOO_MARGIN_S``, stall after twice that).
    - NCCL: ``work.wait()`` does not block the host; the watchdog ends the collective at the process-group
      timeout. The nets are set to that timeout, never later, so a step stuck behind a dead peer stops by then
      even where the watchdog does not tear the process down (``TORCH_NCCL_ASYNC_ERROR_HANDLING`` 0 or 2).
    """
    if not pg_timeout_s > 0:
        raise ValueError(f"`safety_nets(pg_timeout_s={pg_timeout_s})`: the process-group timeout must be > 0 s.")
    if "nccl" in backend.lower():
        return SafetyNets(wait_s=pg_timeout_s, stall_s=pg_timeout_s)
    wait_s = pg_timeout_s + GLOO_MARGIN_S
    return SafetyNets(wait_s=wait_s, stall_s=2 * wait_s)


class PeerFailure(RuntimeError):
    """The schedule stopped on this rank because another rank failed first; the message names that rank."""


def default_store() -> dist.Store:
    """The default process group's c10d store (a private ``torch.distributed`` API, reached through ``_compat``)."""
    return torch_compat.default_store()


def describe(rank: int, err: BaseException) -> str:
    text = f"rank {rank}: {type(err).__name__}: {err}"
    return text if len(text) <= MAX_REPORT_CHARS else text[: MAX_REPORT_CHARS - 3] + "..."


def _quietly(fn: Callable[[], T]) -> T | None:
    """Store access on a failure path: a dead store (its host rank exited) must not hide the real error."""
    try:
        return fn()
    except Exception:  # noqa: BLE001
        return None


class FailureBoard:
    """Failure reports of one training run on a c10d store.

    Args:
        store: the store every rank of the run can reach.
        rank: this rank in the default group.
        world_size: ranks in the default group.
        namespace: key prefix; the same on every rank of the run.
        poll_s: the least time between two reads of the board during a step.
        ack_timeout_s: how long a failed rank waits for the others to acknowledge its report.
    """

    def __init__(
        self, store: dist.Store, rank: int, world_size: int, namespace: str, *, poll_s: float, ack_timeout_s: float
    ) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.namespace = namespace
        self.poll_s = poll_s
        self.ack_timeout_s = ack_timeout_s

    @classmethod
    def for_default_group(cls, namespace: str, *, poll_s: float) -> FailureBoard | None:
        """A board on the default group's store; None without a process group or with one rank."""
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        return cls(
            default_store(), dist.get_rank(), dist.get_world_size(), namespace,
            poll_s=poll_s, ack_timeout_s=2 * poll_s + 1.0,
        )


class FailureWatch:
    """One step's view of a :class:`FailureBoard` (or a no-op without one)."""

    def __init__(self, board: FailureBoard | None, step: int) -> None:
        self._board = board
        self._step = step
        self._rank = board.rank if board is not None else 0
        self._prefix = f"{board.namespace}/{step}" if board is not None else ""
        self._next_poll = time.monotonic() + (board.poll_s if board is not None else 0.0)
        self._peer_text: str | None = None

    # -- while the step runs -------------------------------------------------------------------------------------
    def poll(self) -> str | None:
        """Another rank's report, read at most every ``poll_s`` (and acknowledged once); None if there is none."""
        board = self._board
        if board is None or self._peer_text is not None or time.monotonic() < self._next_poll:
            return self._peer_text
        self._next_poll = time.monotonic() + board.poll_s
        return self._read_peer()

    # -- after the step failed -----------------------------------------------------------------------------------
    def explain(self, err: BaseException) -> BaseException:
        """The exception this rank raises for ``err``: ``err`` itself if this rank failed first (after posting it)
        or met the same error as the rank that did (the same type and message: an error every rank meets), else a
        :class:`PeerFailure` naming the rank that did, chained from ``err``."""
        if isinstance(err, PeerFailure) or self._board is None:
            return err
        peer = self._read_peer()
        if peer is not None and peer.split(": ", 1)[-1] == describe(self._rank, err).split(": ", 1)[-1]:
            return err
        if peer is not None:
            failure = self.peer_failure()
            failure.__cause__ = err
            return failure
        if isinstance(err, Exception):  # not KeyboardInterrupt / SystemExit
            self._post(self._board, err)
        return err

    def peer_failure(self) -> PeerFailure:
        return PeerFailure(
            f"Step {self._step} of the micro-batch schedule stopped on rank {self._rank} because another rank failed "
            f"first: {self._peer_text.rstrip('.')}. Its traceback is in that rank's output; this rank's own error, if "
            "any, is chained below."
        )

    # -- store access ---------------------------------------------------------------------------------------------
    def _read_peer(self) -> str | None:
        board = self._board
        if board is None or self._peer_text is not None:
            return self._peer_text
        store, index = board.store, f"{self._prefix}/failed"
        if not _quietly(lambda: store.check([index])):
            return None
        posted = _quietly(lambda: store.get(index).decode().split()) or []
        peers = [int(rank) for rank in posted if int(rank) != board.rank]
        if not peers:
            return None
        text = _quietly(lambda: store.get(f"{self._prefix}/rank{peers[0]}").decode())
        self._peer_text = text or f"rank {peers[0]}: (report unreadable)"
        _quietly(lambda: store.add(f"{self._prefix}/acks", 1))
        return self._peer_text

    def _post(self, board: FailureBoard, err: BaseException) -> None:
        store, acks = board.store, f"{self._prefix}/acks"
        _quietly(lambda: store.set(f"{self._prefix}/rank{board.rank}", describe(board.rank, err)))
        _quietly(lambda: store.append(f"{self._prefix}/failed", f"{board.rank}\n"))
        deadline = time.monotonic() + board.ack_timeout_s
        while time.monotonic() < deadline:
            count = _quietly(lambda: store.add(acks, 0))
            if count is None or count >= board.world_size - 1:
                return
            time.sleep(0.02)
