"""The link between the comm points of the expert-parallel layers and the overlap engine.

Every communication of a wrapped MoE layer (the token-count exchange, dispatch, combine, and their backward
passes) is a *comm point*. At a comm point the running code does::

    work = communicator.all_to_all(out, inp, ..., group)   # issue
    runtime.handoff()                                       # let other work run while it is in flight
    runtime.wait(work)                                      # then wait for it (``work.wait()``)

``handoff`` first runs this context's queued side work (shared experts under ``shared_expert_overlap``) and the
weight-gradient GEMMs (``delay_wgrad``), then, while the engine has a phase of two execution contexts bound, hands
the baton to the other context and returns once this context holds it again. A metadata exchange (the token
counts, the gathered sizes) calls ``hold_side_work()`` before its ``handoff()``: its transfer is a few integers,
too short to hide a shared MLP, so the side work stays queued for this context's next comm point, the one that
moves tokens. The side-work queues (and the holds) are per context (``pending.py``), so work left queued across a
hand-over is never run by the partner. Outside a schedule (validation, ``overlap=False``) ``handoff`` only runs
the queued work, at the same comm points, so the same code path serves both and the results are bitwise equal.

A ``CommRuntime`` is made of three explicit parts and a list of observers:

- ``phase`` (:class:`~lightning_moe_overlap.overlap.handover.PhaseHandOff`): the bound phase's hand-over, set by the
  engine (``handover.py`` says why it is a field and not a context variable);
- ``pending`` (:class:`~lightning_moe_overlap.overlap.pending.PendingWork`): the side-work queues (one per
  context, keyed by the baton's holder) and the weight-gradient queue, touched only by the context holding the
  baton (``pending.py``);
- ``communicator``: how the dispatchers' collectives are issued, given at construction; ``None`` is
  ``torch.distributed`` (``overlap/communicator.py``; a benchmark passes its loopback instead);
- observers (``observers.py``: timing, traffic, the timeline), attached with :meth:`CommRuntime.attach`. Without
  any, a comm point pays one emptiness test.

One ``CommRuntime`` belongs to one strategy; every wrapped layer holds a reference to it. Nothing is global.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from lightning_moe_overlap.overlap.handover import PhaseHandOff
from lightning_moe_overlap.overlap.observers import CommObserver, Waitable
from lightning_moe_overlap.overlap.pending import PendingWork, SideWork

if TYPE_CHECKING:
    from lightning_moe_overlap.overlap.communicator import Communicator
    from lightning_moe_overlap.overlap.schedule import Role


class ObserverHandle:
    """Detaches one observer: ``handle.remove()``, or leave a ``with runtime.attach(observer) as observer:`` block."""

    def __init__(self, runtime: CommRuntime, observer: CommObserver) -> None:
        self.runtime, self.observer = runtime, observer

    def remove(self) -> None:
        self.runtime._observers = tuple(o for o in self.runtime._observers if o is not self.observer)

    def __enter__(self) -> Any:
        return self.observer

    def __exit__(self, *exc: object) -> None:
        self.remove()


class CommRuntime:
    """Shared by all wrapped MoE layers of one model (see the module docstring).

    Args:
        delay_wgrad: queue expert weight-gradient GEMMs during backward and run them at the next comm point,
            while an all-to-all is in flight, instead of inline.
        communicator: issues the dispatchers' collectives; ``None`` for ``torch.distributed``.
    """

    def __init__(self, delay_wgrad: bool = False, communicator: Communicator | None = None) -> None:
        self.phase = PhaseHandOff()
        self.pending = PendingWork(delay_wgrad)
        self.communicator = communicator
        self._observers: tuple[CommObserver, ...] = ()  # replaced, never mutated: a comm point reads one snapshot

    # -- comm points -------------------------------------------------------------------------------------------
    def handoff(self) -> None:
        """Call right after issuing an async collective and before waiting on it."""
        observers, baton = self._observers, self.phase.bound_handoff
        holder = None if baton is None else baton.holder
        for observer in observers:
            observer.on_issue(holder)
        self.pending.run_side_work(holder)
        self.pending.flush_wgrad()
        if baton is None:
            return
        if not observers:
            baton.handoff()
            return
        for observer in observers:
            observer.on_handoff(holder)
        baton.handoff()
        for observer in observers:
            observer.on_resume(holder)

    def report_host_read(self) -> None:
        """Tell the observers that sizes were read back to the host (``moe/dispatch/host.py``'s ``host_ints``)."""
        observers = self._observers
        if not observers:
            return
        baton = self.phase.bound_handoff
        holder = None if baton is None else baton.holder
        for observer in observers:
            observer.on_host_read(holder)

    def wait(self, work: Waitable) -> Any:
        """Wait for an issued collective (call after ``handoff``), reported to the observers.

        Returns:
            What ``work.wait()`` returns.
        """
        observers = self._observers
        if not observers:
            return work.wait()
        baton = self.phase.bound_handoff
        holder = None if baton is None else baton.holder
        for observer in observers:
            observer.on_wait_start(holder)
        result = work.wait()
        for observer in reversed(observers):
            observer.on_wait_end(holder)
        return result

    # -- observers ---------------------------------------------------------------------------------------------
    def attach(self, observer: CommObserver) -> ObserverHandle:
        """Report every comm point to ``observer`` until the returned handle's ``remove()`` (or the end of a
        ``with runtime.attach(observer) as observer:`` block)."""
        if any(o is observer for o in self._observers):
            raise ValueError(
                f"`CommRuntime.attach`: {type(observer).__name__} is already attached; an observer attached twice "
                "would count every event twice. Remove the first handle, or attach another instance."
            )
        self._observers = (*self._observers, observer)
        return ObserverHandle(self, observer)

    @property
    def observers(self) -> tuple[CommObserver, ...]:
        """The attached observers, first attached first."""
        return self._observers

    # -- queued work (``pending.py``) --------------------------------------------------------------------------
    @property
    def delay_wgrad(self) -> bool:
        return self.pending.delay_wgrad

    def submit(self, fn: Callable[[], Any]) -> SideWork:
        """Run ``fn`` at the calling context's next comm point that moves tokens (while that communication is in
        flight), or on ``result()``; never in the other context (``pending.py``)."""
        return self.pending.submit(fn, self.context)

    def hold_side_work(self) -> None:
        """This context's next ``handoff()`` leaves its queued side work for the comm point after it (call right
        before the hand-over of a metadata exchange)."""
        self.pending.hold_side_work(self.context)

    def run_side_work(self) -> None:
        """Run the calling context's queued side work now (the engine, at the end of a task)."""
        self.pending.drain_side_work(self.context)

    @property
    def context(self) -> Role | None:
        """The running context: the bound phase's baton holder; ``None`` outside a schedule."""
        baton = self.phase.bound_handoff
        return None if baton is None else baton.holder

    def defer_wgrad(self, fn: Callable[[], None]) -> bool:
        """Queue a weight-gradient GEMM when ``delay_wgrad`` is on; False: run it inline (``PendingWork``)."""
        return self.pending.defer_wgrad(fn)

    def flush_wgrad(self) -> None:
        """Run every queued weight-gradient GEMM, oldest first."""
        self.pending.flush_wgrad()

    @contextmanager
    def wgrad_kept(self) -> Iterator[None]:
        """Inside, the comm points leave the queued weight-gradient GEMMs queued, for :meth:`deferred_wgrad` to take:
        the input half of a split pipeline backward, whose weight half runs them (``pipeline/schedules.py``)."""
        self.pending.wgrad_kept = True
        try:
            yield
        finally:
            self.pending.wgrad_kept = False

    def deferred_wgrad(self) -> Callable[[], None]:
        """The weight-gradient GEMMs queued now, taken off the queue, as one call that runs them in their order:
        torch's ``dw_builder`` of a pipeline stage (called at the end of each stage backward; the runner at once after
        a full backward, in the weight action after a split one)."""
        taken = self.pending.take_wgrad()

        def run() -> None:
            for fn in taken:
                fn()

        return run

    @property
    def pending_wgrad(self) -> int:
        return self.pending.pending_wgrad
