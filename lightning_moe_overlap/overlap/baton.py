"""One baton shared by the execution contexts of a phase: only the holder runs.

A phase has one context (``F0``, ``B[M-1]``, every phase of the sequential schedule) or two (``F[i+1]|B[i]``).
Each context runs in its own thread. At a comm point the running context calls :meth:`Baton.handoff`: it gives
the baton to the other context and blocks until it gets it back. When a context finishes, it hands the baton over
for good; from then on the other one runs alone and its hand-overs return at once. A phase with one context never
blocks.

The holder is identified by the baton, not by the calling thread: only the holder can be running, so whoever
calls :meth:`Baton.handoff` is the holder. This matters on CUDA, where autograd runs backward functions (and their
comm points) on the autograd engine's device thread rather than on the thread that called ``.backward()``.

Autograd inside a context: :meth:`Baton.autograd_stuck` reports a holder that entered ``torch.autograd.grad`` or
``backward`` while the other context waits at a comm point on a thread that is not its own (CUDA autograd's device
thread, which the holder's autograd call then waits for: a deadlock the engine turns into an error).

Errors: an exception in a context stops the phase. The other context is woken and raises :class:`BatonAborted`
at its next hand-over (or when it would start), so it issues no further collective. Every wait has a timeout,
a safety net against a partner that is stuck for good; hitting it raises ``RuntimeError`` naming the phase.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence

import torch

from lightning_moe_overlap.overlap.rng_snapshot import RngSource, RngState
from lightning_moe_overlap.overlap.schedule import Role


_AUTOGRAD_ENTRIES = frozenset({torch.autograd.grad.__code__, torch.autograd.backward.__code__})


class BatonAborted(BaseException):
    """Raised in a context at its next hand-over after the phase stopped.

    A ``BaseException`` so that an ``except Exception`` in model code does not swallow it; the engine catches it.
    """


class Baton:
    """The hand-over token of one phase.

    Args:
        roles: the contexts of the phase (one or two distinct roles).
        phase: the phase name, used in error messages.
        starter: the role that holds the baton first.
        timeout_s: the longest a context waits for the baton before it raises ``RuntimeError``.
        rng: the generators the contexts' random streams are kept in (see ``rng_snapshot.py``); by default the CPU one
            and the creating thread's current CUDA device's. The device is fixed here, never read from the thread
            that hands over.
    """

    def __init__(
        self, roles: Sequence[Role], *, phase: str, starter: Role, timeout_s: float, rng: RngSource | None = None
    ) -> None:
        if not 1 <= len(roles) <= 2 or len(set(roles)) != len(roles) or starter not in roles:
            raise ValueError(f"A baton needs one or two distinct roles including the starter, got {roles} / {starter}.")
        self._phase = phase
        self._timeout_s = timeout_s
        self._cond = threading.Condition()
        self._holder = starter
        self._running = set(roles)
        self._stopped = False
        self._errors: list[BaseException] = []
        self._progress = 0
        self._done = threading.Event()
        self._threads: dict[Role, int] = {}  # the thread each context started on (its lane)
        self._parked: dict[Role, int] = {}  # the thread each waiting context called `handoff` from
        # Random streams per context, only where two contexts interleave (see rng_snapshot.py).
        self._rng_source = RngSource.of_current_thread() if rng is None else rng
        start = self._rng_source.capture() if len(roles) == 2 else None
        self._rng: dict[Role, RngState] | None = {role: start for role in roles} if start is not None else None

    # -- the contexts' side ----------------------------------------------------------------------------------------
    def run(self, role: Role, fn: Callable[[], None]) -> None:
        """Run ``fn`` as the ``role`` context: wait for the baton, run, hand it over for good. Never raises."""
        try:
            with self._cond:
                self._threads[role] = threading.get_ident()
                self._wait_for(role)
            fn()
        except BatonAborted:
            pass
        except BaseException as err:  # noqa: BLE001 - recorded, re-raised by the engine in the caller's thread
            self._fail(err)
        finally:
            self._finish(role)

    def handoff(self) -> None:
        """Give the baton to the other context and return when it comes back (at once if there is none)."""
        with self._cond:
            if self._stopped:
                raise BatonAborted(self._phase)
            self._progress += 1
            me = self._holder
            if me.partner not in self._running:
                return
            self._swap_out(me)
            self._holder = me.partner
            self._cond.notify_all()
            self._parked[me] = threading.get_ident()
            try:
                self._wait_for(me)
            finally:
                self._parked.pop(me, None)

    # -- the engine's side -----------------------------------------------------------------------------------------
    def abort(self) -> None:
        """Stop the phase: each context raises :class:`BatonAborted` at its next hand-over."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def fail(self, err: BaseException) -> None:
        """Stop the phase with ``err`` (raised by the engine); the contexts raise :class:`BatonAborted`."""
        self._fail(err)

    def autograd_stuck(self) -> Role | None:
        """The holder, when it is inside ``torch.autograd.grad``/``backward`` while the other context waits at a
        comm point called from a thread other than its own (on CUDA, autograd's one device thread: the holder's
        autograd call needs that thread, which waits for the baton). None otherwise."""
        with self._cond:
            holder = self._holder
            waiting = self._parked.get(holder.partner)
            if waiting is None or waiting == self._threads.get(holder.partner):
                return None
            thread = self._threads.get(holder)
        frame = sys._current_frames().get(thread) if thread is not None else None
        while frame is not None:
            if frame.f_code in _AUTOGRAD_ENTRIES:
                return holder
            frame = frame.f_back
        return None

    def wait_done(self, timeout_s: float) -> bool:
        """Wait until every context has finished; False on timeout."""
        return self._done.wait(timeout_s)

    def continue_rng_from(self, role: Role) -> None:
        """After a pair, let the process's random stream continue from ``role``'s (the forward's: backward only
        replays the masks its forward drew)."""
        if self._rng is not None:
            self._rng[role].restore()

    @property
    def errors(self) -> list[BaseException]:
        """Exceptions raised by the contexts, first one first (aborts excluded)."""
        return list(self._errors)

    @property
    def phase(self) -> str:
        return self._phase

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def holder(self) -> Role:
        """The role that holds the baton now (the running context, when read from model code)."""
        return self._holder

    @property
    def progress(self) -> int:
        """Hand-overs and finished contexts so far; the engine's stall detector watches it."""
        return self._progress

    # -- internals (called with the condition held) ----------------------------------------------------------------
    def _wait_for(self, role: Role) -> None:
        got = self._cond.wait_for(lambda: self._stopped or self._holder is role, self._timeout_s)
        if self._stopped:
            raise BatonAborted(self._phase)
        if not got:
            raise RuntimeError(
                f"Phase {self._phase}: the {role.value} context waited {self._timeout_s:g} s for the baton, which "
                f"the {role.partner.value} context still holds: it is stuck (a collective that never completes, or a "
                "deadlock). If compute between two comm points can legitimately take this long, raise `timeout_s` "
                "(keep it above the process-group timeout)."
            )
        self._swap_in(role)

    def _swap_out(self, role: Role) -> None:
        if self._rng is not None:
            self._rng[role] = self._rng_source.capture()

    def _swap_in(self, role: Role) -> None:
        if self._rng is not None:
            self._rng[role].restore()

    def _fail(self, err: BaseException) -> None:
        with self._cond:
            self._errors.append(err)
            self._stopped = True
            self._cond.notify_all()

    def _finish(self, role: Role) -> None:
        with self._cond:
            self._progress += 1
            self._running.discard(role)
            if self._holder is role:
                self._swap_out(role)
                if role.partner in self._running:
                    self._holder = role.partner  # for good
                    self._cond.notify_all()
            if not self._running:
                self._done.set()
