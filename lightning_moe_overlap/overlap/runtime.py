"""The link between the comm points of the expert-parallel layers and the overlap engine.

Every communication of a wrapped MoE layer (the token-count exchange, dispatch, combine, and their backward
passes) is a *comm point*. At a comm point the running code does::

    work = dist.all_to_all_single(out, inp, ..., async_op=True)   # issue
    runtime.handoff()                                              # let other work run while it is in flight
    work.wait()                                                    # then wait for it

``handoff`` first runs any queued side work (shared experts under ``shared_expert_overlap``) and weight-gradient
GEMMs (``delay_wgrad``), then, while a schedule of two
execution contexts is active, hands the baton to the other context and returns once this context holds it again.
Outside a schedule (validation, ``overlap=False``) it only runs the queued GEMMs, so the same code path serves
both and the results are bitwise equal.

One ``CommRuntime`` belongs to one strategy; every wrapped layer holds a reference to it. Nothing is global.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol


class Baton(Protocol):
    """What the engine provides while a schedule runs: a hand-over to the other context."""

    def handoff(self) -> None: ...


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


class CommRuntime:
    """Shared by all wrapped MoE layers of one model.

    Args:
        delay_wgrad: queue expert weight-gradient GEMMs during backward and run them at the next comm point,
            while an all-to-all is in flight, instead of inline.
    """

    def __init__(self, delay_wgrad: bool = False) -> None:
        self.delay_wgrad = delay_wgrad
        self._baton: Baton | None = None
        self._wgrad: deque[Callable[[], None]] = deque()
        self._side: deque[SideWork] = deque()

    # -- comm points -------------------------------------------------------------------------------------------
    def handoff(self) -> None:
        """Call right after issuing an async collective and before waiting on it."""
        self.run_side_work()
        self.flush_wgrad()
        baton = self._baton
        if baton is not None:
            baton.handoff()

    # -- side work ---------------------------------------------------------------------------------------------
    def submit(self, fn: Callable[[], Any]) -> SideWork:
        """Run ``fn`` at the next comm point (while that communication is in flight), or on ``result()``."""
        work = SideWork(fn)
        self._side.append(work)
        return work

    def run_side_work(self) -> None:
        queue = self._side
        while queue:
            queue.popleft().run()

    # -- delayed weight gradients ----------------------------------------------------------------------------
    def defer_wgrad(self, fn: Callable[[], None]) -> bool:
        """Queue ``fn`` (it computes and accumulates one weight gradient) if ``delay_wgrad`` is on.

        Returns False when the caller must run it inline. Queued functions run in FIFO order, so the
        accumulation order into ``.grad`` is the order of the inline path.
        """
        if not self.delay_wgrad:
            return False
        self._wgrad.append(fn)
        return True

    def flush_wgrad(self) -> None:
        """Run every queued weight-gradient GEMM, oldest first."""
        queue = self._wgrad
        while queue:
            queue.popleft()()

    @property
    def pending_wgrad(self) -> int:
        return len(self._wgrad)

    # -- engine side -------------------------------------------------------------------------------------------
    @contextmanager
    def overlapping(self, baton: Baton) -> Iterator[None]:
        """Route hand-overs to ``baton`` for the duration of one overlapped phase."""
        if self._baton is not None:
            raise RuntimeError("`CommRuntime.overlapping`: a schedule is already active on this runtime.")
        self._baton = baton
        try:
            yield
        finally:
            self._baton = None
