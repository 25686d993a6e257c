"""The link between the comm points of the expert-parallel layers and the overlap engine.

Every communication of a wrapped MoE layer (the token-count exchange, dispatch, combine, and their backward
passes) is a *comm point*. At a comm point the running code does::

    work = dist.all_to_all_single(out, inp, ..., async_op=True)   # issue
    runtime.handoff()                                              # let other work run while it is in flight
    runtime.wait(work)                                             # then wait for it (``work.wait()``, timed)

``handoff`` first runs any queued side work (shared experts under ``shared_expert_overlap``) and weight-gradient
GEMMs (``delay_wgrad``), then, while a schedule of two
execution contexts is active, hands the baton to the other context and returns once this context holds it again.
Outside a schedule (validation, ``overlap=False``) it only runs the queued GEMMs, so the same code path serves
both and the results are bitwise equal.

One ``CommRuntime`` belongs to one strategy; every wrapped layer holds a reference to it. Nothing is global.

Timing (opt-in): attach a :class:`CommTimer` (``runtime.timing = CommTimer()`` or ``with runtime.timed() as
timer:``) and every ``runtime.wait(work)`` records how long the caller was blocked in the wait, i.e. the
communication that nothing hid, and how long the collective was in flight (from the hand-over that followed its
issue to the end of the wait). Without a timer ``wait`` is ``work.wait()`` plus one attribute test.

Traffic (opt-in): attach a :class:`CommTraffic` (``runtime.traffic = CommTraffic()``) and every all-to-all of the
dispatchers adds the bytes it sends, in total and to other ranks (the part that crosses the wire).

Timeline (opt-in): attach a :class:`TraceSink` (``runtime.trace = TimelineRecorder()``, see ``timeline.py``) and
every comm point also reports its issue, hand-over, resumption and wait, with the role holding the baton.
Without one, each comm point pays one more attribute test.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol


class HandOff(Protocol):
    """What the engine provides while a schedule runs: a hand-over to the other context (``overlap/baton.py``'s
    :class:`~lightning_moe_overlap.overlap.baton.Baton` is one)."""

    def handoff(self) -> None: ...


class TraceSink(Protocol):
    """Receives the comm-point events of a :class:`CommRuntime` (``overlap/timeline.py`` records them).

    ``baton`` is the active phase's baton (``baton.holder`` is the running context), or ``None`` outside a
    schedule.
    """

    def task_started(self, task: Any) -> None: ...

    def task_finished(self, task: Any) -> None: ...

    def comm_issued(self, baton: Any) -> None: ...

    def handing_over(self, baton: Any) -> None: ...

    def resumed(self, baton: Any) -> None: ...

    def wait_started(self, baton: Any) -> float: ...

    def wait_ended(self, baton: Any, started: float) -> None: ...


class Waitable(Protocol):
    """An issued asynchronous collective (``torch.distributed`` ``Work``)."""

    def wait(self) -> Any: ...


@dataclass(frozen=True)
class CommTimes:
    """Totals recorded by a :class:`CommTimer`.

    Attributes:
        waits: collectives waited on.
        blocked_s: seconds the callers were blocked in ``wait``: the exposed (un-hidden) communication.
        in_flight_s: seconds from each collective's hand-over (right after its issue) to the end of its wait.
            Equal to the collective's duration when the wait blocked; an upper bound when it had already
            finished (the other context's compute ran longer).
        max_blocked_s: the longest single wait.
    """

    waits: int = 0
    blocked_s: float = 0.0
    in_flight_s: float = 0.0
    max_blocked_s: float = 0.0


class CommTimer:
    """Records the waits of the comm points of a :class:`CommRuntime` it is attached to.

    Both contexts of a schedule record into the same timer (a lock keeps the totals consistent).

    Args:
        synchronize: called when a collective is handed over and again after its wait, inside the timed span,
            e.g. ``lambda: torch.cuda.current_stream().synchronize()`` to time device-side durations (NCCL's
            ``wait`` does not block the host; the compute stream waits for the collective after it). It blocks the
            host on the device, which defeats overlap: use it only to measure the sequential run.
    """

    def __init__(self, synchronize: Callable[[], None] | None = None) -> None:
        self.synchronize = synchronize
        self._lock = threading.Lock()
        self._issued = threading.local()
        self._totals = CommTimes()

    def mark_issued(self) -> None:
        """Called by the runtime at the hand-over that follows an issue (per thread, the latest one wins)."""
        if self.synchronize is not None:
            self.synchronize()
        self._issued.at = time.perf_counter()

    def wait(self, work: Waitable) -> Any:
        """``work.wait()``, timed; returns what it returns."""
        start = time.perf_counter()
        result = work.wait()
        if self.synchronize is not None:
            self.synchronize()
        end = time.perf_counter()
        issued = getattr(self._issued, "at", None)
        self._issued.at = None
        self.record(end - start, end - (start if issued is None else issued))
        return result

    def record(self, blocked_s: float, in_flight_s: float) -> None:
        """Add one wait to the totals."""
        with self._lock:
            t = self._totals
            self._totals = CommTimes(
                t.waits + 1, t.blocked_s + blocked_s, t.in_flight_s + in_flight_s, max(t.max_blocked_s, blocked_s)
            )

    def snapshot(self) -> CommTimes:
        """The totals so far."""
        with self._lock:
            return self._totals

    def reset(self) -> CommTimes:
        """Zero the totals; returns those before the reset."""
        with self._lock:
            totals, self._totals = self._totals, CommTimes()
            return totals


class CommTraffic:
    """Bytes sent by the all-to-alls of a :class:`CommRuntime` it is attached to (forward and backward).

    Attributes:
        collectives: all-to-alls counted.
        sent_bytes: bytes handed to the collectives, the rows a rank keeps for itself included.
        remote_bytes: bytes sent to other ranks (what crosses the wire); with a loopback (simulated expert
            parallelism) everything it sends.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.collectives = 0
        self.sent_bytes = 0
        self.remote_bytes = 0

    def record(self, sent_bytes: int, remote_bytes: int) -> None:
        """Add one all-to-all."""
        with self._lock:
            self.collectives += 1
            self.sent_bytes += sent_bytes
            self.remote_bytes += remote_bytes

    def reset(self) -> tuple[int, int, int]:
        """Zero the totals; returns ``(collectives, sent_bytes, remote_bytes)`` before the reset."""
        with self._lock:
            totals = (self.collectives, self.sent_bytes, self.remote_bytes)
            self.collectives = self.sent_bytes = self.remote_bytes = 0
            return totals


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
        self._baton: HandOff | None = None
        self._wgrad: deque[Callable[[], None]] = deque()
        self._side: deque[SideWork] = deque()
        self.timing: CommTimer | None = None  # opt-in: see `timed` and `wait`
        # Simulated expert parallelism (benchmarks, ``moe/dispatch/loopback.py``): with one rank in the ep group, the
        # all-to-alls are issued through ``loopback(out, inp) -> Waitable`` instead of being skipped.
        self.loopback: Callable[[Any, Any], Waitable] | None = None
        self.trace: TraceSink | None = None  # opt-in: the timeline of a step (overlap/timeline.py)
        self.traffic: CommTraffic | None = None  # opt-in: bytes sent by the all-to-alls

    # -- comm points -------------------------------------------------------------------------------------------
    def handoff(self) -> None:
        """Call right after issuing an async collective and before waiting on it."""
        timing, trace, baton = self.timing, self.trace, self._baton
        if timing is not None:
            timing.mark_issued()
        if trace is not None:
            trace.comm_issued(baton)
        self.run_side_work()
        self.flush_wgrad()
        if baton is not None:
            if trace is None:
                baton.handoff()
                return
            trace.handing_over(baton)
            baton.handoff()
            trace.resumed(baton)

    def wait(self, work: Waitable) -> Any:
        """Wait for an issued collective (call after ``handoff``); timed when a :class:`CommTimer` is attached.

        Returns:
            What ``work.wait()`` returns.
        """
        timing, trace = self.timing, self.trace
        if trace is None:
            return work.wait() if timing is None else timing.wait(work)
        baton = self._baton
        started = trace.wait_started(baton)
        result = work.wait() if timing is None else timing.wait(work)
        trace.wait_ended(baton, started)
        return result

    @contextmanager
    def timed(self, timer: CommTimer | None = None) -> Iterator[CommTimer]:
        """Attach ``timer`` (a new one by default) for the block; the previous one is restored afterwards."""
        attached = timer if timer is not None else CommTimer()
        previous, self.timing = self.timing, attached
        try:
            yield attached
        finally:
            self.timing = previous

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
    def overlapping(self, baton: HandOff) -> Iterator[None]:
        """Route hand-overs to ``baton`` for the duration of one overlapped phase."""
        if self._baton is not None:
            raise RuntimeError("`CommRuntime.overlapping`: a schedule is already active on this runtime.")
        self._baton = baton
        try:
            yield
        finally:
            self._baton = None
