"""A termination signal ends the run at a batch boundary on every rank, never inside a collective.

Lightning's SIGTERM handler broadcasts from inside the signal handler. Python runs a handler on the main thread
between two bytecodes, so a signal that lands while a collective sequence is in flight (a checkpoint's save: DCP's
plan gathers, the commit barriers) starts that broadcast in the middle of it: the ranks' collectives no longer pair
up, and every rank waits out the process group's timeout (30 minutes by default) before it dies.

:class:`SignalAgreement` replaces that handler (from the first batch of each loop on) with one that only records the
signal and forwards it to the processes this one launched, as Lightning's does. What is in flight, a checkpoint save
included, runs to its end. At the start of the next batch, where every rank is and no collective is in flight, the
ranks agree on it with one all-reduce of a flag; if any rank received the signal, every rank marks it (Lightning's
``trainer.received_sigterm``) and raises Lightning's ``SIGTERMException`` there together (exit status 143 rather
than Lightning's 0, so a job script tells a preempted run from a finished one), so Lightning's interrupt
path (the callbacks' ``on_exception``, teardown) runs on all of them and the run ends within seconds. A checkpoint
is therefore never left half written by the signal itself; a save killed harder (SIGKILL after a scheduler's grace
period) leaves a ``.partial-`` entry that no loader accepts (``checkpoint/atomic.py``).
"""

from __future__ import annotations

import contextlib
import signal
from types import FrameType

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_moe_overlap._compat import lightning as pl_compat


EXIT_STATUS = 128 + signal.SIGTERM  # 143, as a shell reports a process SIGTERM ended: preempted, not finished


class SignalAgreement:
    """The run's SIGTERM: recorded by the handler, acted on by every rank together at a batch boundary.

    Attributes:
        received: this process received SIGTERM since the handler was installed.
        installed: the handler is in place for the current loop.
    """

    def __init__(self) -> None:
        self.received = False
        self.installed = False
        self._trainer: object | None = None

    def install(self, trainer: object) -> None:
        """Put :meth:`notify` in place of Lightning's SIGTERM notifier for this run (its other handlers kept).
        Idempotent; nothing where the handler is not Lightning's."""
        self._trainer = trainer
        if not self.installed:
            self.installed = pl_compat.replace_sigterm_notifier(trainer, self.notify)

    def notify(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler: record the signal and, the first time, forward it to the launched processes. No
        collective, no lock: it may run in the middle of any of them."""
        first = not self.received
        self.received = True
        if first:
            with contextlib.suppress(RuntimeError):  # a print it interrupted on the same stream: stay silent
                rank_zero_info(
                    f"`MoEOverlapStrategy`: received signal {signum}: the work in flight (a checkpoint being written "
                    "included) completes, then every rank stops at the next batch."
                )
        launcher = getattr(getattr(self._trainer, "strategy", None), "launcher", None)
        if first and launcher is not None:
            launcher.kill(signum)

    def agree(self, device: torch.device) -> None:
        """At a batch boundary (every rank, no collective in flight): whether any rank received the signal; if one
        did, mark it on the trainer and raise ``SIGTERMException`` on every rank. One all-reduce of a flag where
        distributed.

        Raises:
            SIGTERMException: some rank received SIGTERM.
        """
        if not self.installed:
            return
        stop = self.received
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([int(self.received)], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = bool(flag.item())
        if stop:
            pl_compat.mark_sigterm_received(self._trainer)
            raise SIGTERMException(EXIT_STATUS)

    def uninstall(self) -> None:
        """At teardown (Lightning restores the handlers it replaced): the next run installs again."""
        self.installed = False
        self.received = False
        self._trainer = None
