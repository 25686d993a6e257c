"""Comm-point timing on the device: CUDA events, read once when the totals are asked for.

On CUDA a comm point's ``work.wait()`` does not block the host: it makes the current (compute) stream wait for
the collective. :class:`EventCommTimer`, an observer of the comm runtime like :class:`CommTimer`, records three
events on the current stream per comm point: at the issue, right before the wait and right after it. On the
device, the last two complete when the compute queued before the wait finished and when the stream may continue
past the collective: their difference is the time the compute stream stalled on the collective, the *exposed*
communication; issue to after-wait is the time it was in flight. Nothing is read on the hot path:
:meth:`EventCommTimer.snapshot` (or ``reset``) synchronizes on the recorded events once and adds them up.

``event_factory`` makes the events (``torch.cuda.Event(enable_timing=True)`` by default); the CPU tests pass
host-clock events with the same ``record`` / ``synchronize`` / ``elapsed_time`` interface.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from lightning_moe_overlap.overlap.observers import CommTimer, CommTimes

if TYPE_CHECKING:
    from lightning_moe_overlap.overlap.schedule import Role


class TimingEvent(Protocol):
    def record(self) -> None: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end: Any) -> float: ...  # milliseconds


def _cuda_event() -> TimingEvent:
    import torch

    return torch.cuda.Event(enable_timing=True)


class EventCommTimer(CommTimer):
    """A :class:`CommTimer` that measures on the device (see the module docstring).

    Args:
        event_factory: makes one timing event; CUDA events by default.
    """

    def __init__(self, event_factory: Callable[[], TimingEvent] | None = None) -> None:
        super().__init__()
        self._event = event_factory or _cuda_event
        self._pending: list[tuple[TimingEvent, TimingEvent, TimingEvent]] = []

    def mark_issued(self) -> None:
        event = self._event()
        event.record()
        self._point.issued = event

    def on_wait_start(self, holder: Role | None = None) -> None:
        before = self._event()
        before.record()
        self._point.wait_start = before

    def on_wait_end(self, holder: Role | None = None) -> None:
        after = self._event()
        after.record()
        before = self._point.wait_start
        issued = getattr(self._point, "issued", None)
        self._point.issued = None
        with self._lock:
            self._pending.append((issued if issued is not None else before, before, after))

    def _resolve(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for issued, before, after in pending:
            after.synchronize()  # NOTE: D2H sync (once per read, never on the hot path)
            blocked_s = max(0.0, before.elapsed_time(after) / 1e3)
            self.record(blocked_s, max(blocked_s, issued.elapsed_time(after) / 1e3))

    def snapshot(self) -> CommTimes:
        self._resolve()
        return super().snapshot()

    def reset(self) -> CommTimes:
        self._resolve()
        return super().reset()
