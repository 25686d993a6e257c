"""Observers of the comm points: timing, traffic and the timeline all receive the same few events.

A :class:`CommObserver` is attached to a :class:`~lightning_moe_overlap.overlap.runtime.CommRuntime` with
``runtime.attach(observer)`` (``handle.remove()`` detaches it; the handle is also a context manager). Every comm
point then reports, in this order::

    on_issue(holder)           a collective was issued (before the side work and the hand-over)
    on_handoff(holder)         the context is about to hand the baton over (only while a schedule runs)
    on_resume(holder)          it holds the baton again
    on_wait_start(holder)      it starts waiting for the collective
    on_wait_end(holder)        the wait returned

``on_host_read(holder)`` reports each read of sizes back to the host (the split sizes an uneven all-to-all takes as
Python ints, ``moe/dispatch/host.py``); the dispatchers make it after a comm point's wait, never between its issue
and its hand-over (``order.py`` records the order, ``docs/overlap.md``, "Host reads and hand-overs").
``on_traffic(sent_bytes, remote_bytes)`` follows every all-to-all's issue, and the engine reports each task's
``on_task_start(task)`` / ``on_task_end(task)``. ``holder`` is the role holding the baton (the running context), or
``None`` outside a schedule. Events of one comm point arrive on one thread; the two contexts of a schedule report to
the same observer, so an observer that keeps totals locks them.

Built in: :class:`CommTimer` (blocked and in-flight time of the waits), :class:`CommTraffic` (bytes sent) and
``timeline.py``'s ``TimelineRecorder`` (a step's timeline). Without observers a comm point pays one emptiness test.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from lightning_moe_overlap.overlap.schedule import Role, Task


class Waitable(Protocol):
    """An issued asynchronous collective (``torch.distributed`` ``Work``)."""

    def wait(self) -> Any: ...


class CommObserver:
    """Receives the events listed in the module docstring; every hook does nothing unless overridden."""

    def on_task_start(self, task: Task) -> None:
        pass

    def on_task_end(self, task: Task) -> None:
        pass

    def on_issue(self, holder: Role | None) -> None:
        pass

    def on_handoff(self, holder: Role | None) -> None:
        pass

    def on_resume(self, holder: Role | None) -> None:
        pass

    def on_wait_start(self, holder: Role | None) -> None:
        pass

    def on_wait_end(self, holder: Role | None) -> None:
        pass

    def on_traffic(self, sent_bytes: int, remote_bytes: int) -> None:
        pass

    def on_host_read(self, holder: Role | None) -> None:
        pass


@dataclass(frozen=True)
class CommTimes:
    """Totals recorded by a :class:`CommTimer`.

    Attributes:
        waits: collectives waited on.
        blocked_s: seconds the callers were blocked in ``wait``: the exposed (un-hidden) communication.
        in_flight_s: seconds from each collective's issue to the end of its wait. Equal to the collective's
            duration when the wait blocked; an upper bound when it had already finished (the other context's
            compute ran longer).
        max_blocked_s: the longest single wait.
    """

    waits: int = 0
    blocked_s: float = 0.0
    in_flight_s: float = 0.0
    max_blocked_s: float = 0.0


class CommTimer(CommObserver):
    """Times the waits of the comm points: how long each blocked its caller, how long its collective was in flight.

    Both contexts of a schedule record into the same timer (a lock keeps the totals consistent); the issue and
    wait times of a comm point are kept per thread (a comm point runs on one thread).

    Args:
        synchronize: called at the issue and again after the wait, inside the timed span, e.g.
            ``lambda: torch.cuda.current_stream().synchronize()`` to time device-side durations (NCCL's ``wait``
            does not block the host; the compute stream waits for the collective after it). It blocks the host on
            the device, which defeats overlap: use it only to measure the sequential run.
    """

    def __init__(self, synchronize: Callable[[], None] | None = None) -> None:
        self.synchronize = synchronize
        self._lock = threading.Lock()
        self._point = threading.local()  # this thread's comm point: `.issued`, `.wait_start`
        self._totals = CommTimes()

    # -- observer hooks ------------------------------------------------------------------------------------------
    def on_issue(self, holder: Role | None = None) -> None:
        self.mark_issued()

    def on_wait_start(self, holder: Role | None = None) -> None:
        self._point.wait_start = time.perf_counter()

    def on_wait_end(self, holder: Role | None = None) -> None:
        if self.synchronize is not None:
            self.synchronize()
        end = time.perf_counter()
        start = self._point.wait_start
        issued = getattr(self._point, "issued", None)
        self._point.issued = None
        self.record(end - start, end - (start if issued is None else issued))

    # -- direct use ----------------------------------------------------------------------------------------------
    def mark_issued(self) -> None:
        """A collective was issued on this thread (the latest one wins)."""
        if self.synchronize is not None:
            self.synchronize()
        self._point.issued = time.perf_counter()

    def wait(self, work: Waitable) -> Any:
        """``work.wait()``, timed; returns what it returns."""
        self.on_wait_start()
        result = work.wait()
        self.on_wait_end()
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


class CommTraffic(CommObserver):
    """Bytes sent by the all-to-alls (forward and backward).

    Attributes:
        collectives: all-to-alls counted.
        sent_bytes: bytes handed to the collectives, the rows a rank keeps for itself included.
        remote_bytes: bytes sent to other ranks (what crosses the wire); with a loopback communicator (simulated
            expert parallelism) everything it sends.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.collectives = 0
        self.sent_bytes = 0
        self.remote_bytes = 0

    def on_traffic(self, sent_bytes: int, remote_bytes: int) -> None:
        self.record(sent_bytes, remote_bytes)

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
