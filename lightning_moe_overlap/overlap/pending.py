"""Work queued for the next comm point: side work (the shared experts) and delayed weight-gradient GEMMs.

Side work is queued per execution context: :meth:`PendingWork.submit` files it under the context that submits it
(the baton's holder, ``Role.FORWARD`` or ``Role.BACKWARD``; ``None`` outside a schedule) and
:meth:`PendingWork.run_side_work` runs only the queue of the context that calls it. A context's side work is
therefore run by that context only: at its own comm points, by ``result()`` (the block that submitted it), or at
the end of its task (the engine). A metadata exchange (the token counts, the gathered sizes: a transfer too short
to hide it) calls :meth:`PendingWork.hold_side_work` for its context right before its hand-over, so that the
side work stays queued until that context's next comm point, the one that moves tokens. Meanwhile the baton may
pass: the partner context's comm points run the partner's queue, never this one, and its holds are its own. The
contexts are named by role, not by thread, as the baton names its holder (on CUDA a backward comm point runs on
autograd's device thread, not on the context's lane).

Which thread touches the queues: only the context that holds the phase's baton, on whatever thread runs it (its
lane, or on CUDA autograd's device thread for its backward), since only the holder runs. The weight gradients are
one queue: a comm point drains it before it passes the baton, and the engine flushes it at the end of every
backward task, so what a context queued is run by that context. No lock is needed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_moe_overlap.overlap.schedule import Role


class SideWork:
    """A computation submitted to run at the next comm point; ``result()`` runs it now if it has not run yet."""

    __slots__ = ("_fn", "_done", "_value")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn: Callable[[], Any] | None = fn
        self._done = False
        self._value: Any = None

    def run(self) -> None:
        if not self._done:
            fn, self._fn = self._fn, None
            self._value = fn()  # type: ignore[misc]
            self._done = True

    def result(self) -> Any:
        self.run()
        return self._value


class PendingWork:
    """The side-work queues, one per execution context, and the weight-gradient queue (module docstring).

    Args:
        delay_wgrad: queue expert weight-gradient GEMMs during backward and run them at the next comm point,
            while an all-to-all is in flight, instead of inline.
    """

    __slots__ = ("delay_wgrad", "_side", "_held", "_wgrad", "wgrad_kept")

    def __init__(self, delay_wgrad: bool = False) -> None:
        self.delay_wgrad = delay_wgrad
        self._side: dict[Role | None, deque[SideWork]] = {}  # per context: its role, None outside a schedule
        self._held: set[Role | None] = set()  # contexts whose next comm point leaves their side work queued
        self._wgrad: deque[Callable[[], None]] = deque()
        self.wgrad_kept = False  # the comm points leave the queue alone (a split backward's input half)

    def submit(self, fn: Callable[[], Any], context: Role | None) -> SideWork:
        """Run ``fn`` at ``context``'s next comm point that runs side work (while that communication is in
        flight), or on ``result()``, whichever comes first."""
        work = SideWork(fn)
        self._side.setdefault(context, deque()).append(work)
        return work

    def hold_side_work(self, context: Role | None) -> None:
        """``context``'s next :meth:`run_side_work` (this comm point's hand-over) leaves its side work queued.

        A metadata exchange calls it right before its hand-over; the side work then runs at the context's next
        comm point. The hold is the context's own and lasts one call, made before the baton passes.
        """
        self._held.add(context)

    def run_side_work(self, context: Role | None) -> None:
        """At a comm point: run ``context``'s queued side work, oldest first, unless :meth:`hold_side_work` held
        this call back; the other context's side work stays queued."""
        if context in self._held:
            self._held.discard(context)
            return
        self.drain_side_work(context)

    def drain_side_work(self, context: Role | None) -> None:
        """Run ``context``'s queued side work now, held or not (the end of its task)."""
        self._held.discard(context)
        queue = self._side.get(context)
        while queue:
            queue.popleft().run()

    def queued_side_work(self, context: Role | None) -> int:
        """How many side works ``context`` has queued (run by ``result()`` or not)."""
        return len(self._side.get(context, ()))

    def defer_wgrad(self, fn: Callable[[], None]) -> bool:
        """Queue ``fn`` (it computes and accumulates one weight gradient) if ``delay_wgrad`` is on.

        Returns False when the caller must run it inline. Queued functions run in FIFO order, so the
        accumulation order into ``.grad`` is the order of the inline path.
        """
        if not self.delay_wgrad:
            return False
        self._wgrad.append(fn)
        return True

    def take_wgrad(self) -> list[Callable[[], None]]:
        """Every queued weight-gradient GEMM, oldest first, removed from the queue (the caller runs them later: a
        pipeline stage's weight action, ``pipeline/schedules.py``)."""
        taken = list(self._wgrad)
        self._wgrad.clear()
        return taken

    def flush_wgrad(self) -> None:
        """Run every queued weight-gradient GEMM, oldest first; nothing while :attr:`wgrad_kept` (the GEMMs wait for
        :meth:`take_wgrad`)."""
        if self.wgrad_kept:
            return
        queue = self._wgrad
        while queue:
            queue.popleft()()

    @property
    def pending_wgrad(self) -> int:
        return len(self._wgrad)
