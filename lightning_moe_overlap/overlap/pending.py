"""Work queued for the next comm point: side work (the shared experts) and delayed weight-gradient GEMMs.

Which thread touches the queues: only the context that holds the phase's baton, on whatever thread runs it (its
lane, or on CUDA autograd's device thread for its backward), since only the holder runs. A comm point drains both
queues before it passes the baton, and the engine flushes the weight gradients at the end of every backward task,
so what a context queued is run by that context. Side work is taken by the block that submitted it (``result()``)
or runs at its own next comm point. No lock is needed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any


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
    """The two queues (see the module docstring).

    Args:
        delay_wgrad: queue expert weight-gradient GEMMs during backward and run them at the next comm point,
            while an all-to-all is in flight, instead of inline.
    """

    __slots__ = ("delay_wgrad", "_side", "_wgrad")

    def __init__(self, delay_wgrad: bool = False) -> None:
        self.delay_wgrad = delay_wgrad
        self._side: deque[SideWork] = deque()
        self._wgrad: deque[Callable[[], None]] = deque()

    def submit(self, fn: Callable[[], Any]) -> SideWork:
        """Run ``fn`` at the next comm point (while that communication is in flight), or on ``result()``."""
        work = SideWork(fn)
        self._side.append(work)
        return work

    def run_side_work(self) -> None:
        queue = self._side
        while queue:
            queue.popleft().run()

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
