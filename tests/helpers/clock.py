"""A clock the test moves by hand, and a fake collective that completes at a time on it.

Timing code under test reads ``time.perf_counter``; :meth:`VirtualClock.install` points a module's ``time`` at this
clock, so the durations it measures follow from the order of events alone (compute advances the clock, a wait
moves it to the collective's completion) and never from how loaded the machine is.
"""

from __future__ import annotations

import threading
from types import ModuleType, SimpleNamespace

import pytest


class VirtualClock:
    """Seconds that pass only when the test says so; safe to read and move from several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Compute that takes ``seconds``."""
        with self._lock:
            self.now += seconds

    def advance_to(self, at: float) -> None:
        """Block until ``at`` (no time passes when it is already later)."""
        with self._lock:
            self.now = max(self.now, at)

    def install(self, monkeypatch: pytest.MonkeyPatch, *modules: ModuleType) -> VirtualClock:
        """Make ``time.perf_counter`` (and ``time.sleep``) of ``modules`` this clock for the test."""
        for module in modules:
            monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=self, sleep=self.advance))
        return self


class TimedWork:
    """A fake collective issued now (its construction) that completes ``duration_s`` later on ``clock``."""

    def __init__(self, clock: VirtualClock, duration_s: float) -> None:
        self.clock = clock
        self.done_at = clock() + duration_s
        self.waits = 0

    def wait(self) -> bool:
        self.waits += 1
        self.clock.advance_to(self.done_at)
        return True
