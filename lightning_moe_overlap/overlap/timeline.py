"""The timeline of one step on one rank: which context ran when, and every comm point's issue, wait and exposure.

A :class:`TimelineRecorder` is a :class:`~lightning_moe_overlap.overlap.observers.CommObserver`: attach it to the
runtime (``runtime.attach(recorder)``) for one step and the engine and the comm points report to it. It keeps
three kinds of record, all on the host clock (``time.perf_counter``), relative to the step's first task:

- :class:`RunSpan`: a context held the baton and ran (``F1`` from its start, or its return from a hand-over,
  until its next hand-over or its end);
- :class:`CommSpan`: one comm point: issued at ``issued``, waited on from ``wait_start`` to ``wait_end``. The
  wait is the *exposed* part (nothing hid it); ``wait_end - issued`` is how long the collective was in flight.

On CUDA the host clock says when a context *enqueued* its kernels and when the host wait returned (NCCL's wait
does not block the host): the picture shows the schedule, the per-step metrics of
:class:`~lightning_moe_overlap.callbacks.monitor.MoEMonitor` the device-side exposure.

:func:`chrome_trace` turns the records of every rank into a ``torch.profiler``-compatible Chrome trace
(``{"traceEvents": [...]}``; open it in https://ui.perfetto.dev or ``chrome://tracing``): one process per rank,
one thread per context for its compute, one per context for its communication. ``timeline_plot.py`` draws the
same records as a PNG.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_moe_overlap.overlap.observers import CommObserver
from lightning_moe_overlap.overlap.schedule import Role, Task

Clock = Callable[[], float]


@dataclass(frozen=True)
class RunSpan:
    """A context ran ``task`` (e.g. ``"F1"``) from ``start`` to ``end`` seconds."""

    role: str
    task: str
    start: float
    end: float


@dataclass(frozen=True)
class CommSpan:
    """Comm point ``index`` (counted per task from 0) of ``task``: issued, then waited on."""

    role: str
    task: str
    index: int
    issued: float
    wait_start: float
    wait_end: float

    @property
    def exposed(self) -> float:
        return self.wait_end - self.wait_start

    @property
    def in_flight(self) -> float:
        return self.wait_end - self.issued


@dataclass
class StepTimeline:
    """The records of one step on one rank."""

    rank: int = 0
    runs: list[RunSpan] = field(default_factory=list)
    comms: list[CommSpan] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "runs": [asdict(r) for r in self.runs], "comms": [asdict(c) for c in self.comms]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepTimeline:
        return cls(
            rank=int(data["rank"]),
            runs=[RunSpan(**r) for r in data["runs"]],
            comms=[CommSpan(**c) for c in data["comms"]],
        )


class TimelineRecorder(CommObserver):
    """Records one step's :class:`StepTimeline` (see the module docstring); ``runtime.attach(recorder)``.

    Args:
        rank: written into the timeline (the trace's process id).
        clock: seconds, monotonic; ``time.perf_counter`` by default.
    """

    def __init__(self, rank: int = 0, clock: Clock = time.perf_counter) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._timeline = StepTimeline(rank=rank)
        self._origin: float | None = None
        self._task: dict[Role, str] = {}
        self._running_since: dict[Role, float] = {}
        self._issued: dict[Role, float] = {}
        self._wait_start: dict[Role, float] = {}  # absolute clock, per context (one wait at a time each)
        self._comm_index: dict[str, int] = {}

    # -- engine side -----------------------------------------------------------------------------------------------
    def on_task_start(self, task: Task) -> None:
        with self._lock:
            now = self._now()
            self._task[task.role] = task.name
            self._running_since[task.role] = now

    def on_task_end(self, task: Task) -> None:
        with self._lock:
            self._close_run(task.role, self._now())

    # -- comm points (``holder``: the context that runs; ``None`` outside a schedule, not recorded) -------------------
    def on_issue(self, holder: Role | None) -> None:
        if holder is not None:
            with self._lock:
                self._issued[holder] = self._now()

    def on_handoff(self, holder: Role | None) -> None:
        if holder is not None:
            with self._lock:
                self._close_run(holder, self._now())

    def on_resume(self, holder: Role | None) -> None:
        if holder is not None:
            with self._lock:
                self._running_since[holder] = self._now()

    def on_wait_start(self, holder: Role | None) -> None:
        if holder is not None:
            self._wait_start[holder] = self.clock()

    def on_wait_end(self, holder: Role | None) -> None:
        if holder is None:
            return
        with self._lock:
            end = self._now()
            task = self._task.get(holder, "?")
            start = self._relative(self._wait_start.pop(holder))
            issued = self._issued.pop(holder, start)
            index = self._comm_index.get(task, 0)
            self._comm_index[task] = index + 1
            self._timeline.comms.append(CommSpan(holder.value, task, index, issued, start, end))

    # -- result ----------------------------------------------------------------------------------------------------
    def timeline(self) -> StepTimeline:
        """The records so far (spans still open are not included)."""
        with self._lock:
            t = self._timeline
            return StepTimeline(t.rank, list(t.runs), list(t.comms))

    # -- internals (lock held) -------------------------------------------------------------------------------------
    def _now(self) -> float:
        return self._relative(self.clock())

    def _relative(self, t: float) -> float:
        if self._origin is None:
            self._origin = t
        return t - self._origin

    def _close_run(self, role: Role, now: float) -> None:
        start = self._running_since.pop(role, None)
        if start is not None:
            self._timeline.runs.append(RunSpan(role.value, self._task.get(role, "?"), start, now))


# -- Chrome trace ----------------------------------------------------------------------------------------------------
_THREADS = {("forward", "run"): 0, ("backward", "run"): 1, ("forward", "comm"): 2, ("backward", "comm"): 3}
_THREAD_NAMES = {
    0: "forward context",
    1: "backward context",
    2: "forward all-to-all (in flight)",
    3: "backward all-to-all (in flight)",
}


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def chrome_trace(timelines: Iterable[StepTimeline], step: int | None = None) -> dict[str, Any]:
    """A Chrome trace (``{"traceEvents": [...]}``) of one step on every rank given.

    Events: ``X`` spans named after the task (``F1``, category ``compute``) while a context ran; a ``comm`` span
    per comm point from its issue to the end of its wait (``args`` hold the exposed and in-flight microseconds);
    an ``exposed`` span (category ``exposed``) inside the context's own row while it was blocked in the wait;
    ``i`` instants where each collective was issued.
    """
    events: list[dict[str, Any]] = []
    for timeline in timelines:
        pid = timeline.rank
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"rank {pid}"}})
        for tid, name in _THREAD_NAMES.items():
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
        for run in timeline.runs:
            events.append({
                "ph": "X", "cat": "compute", "name": run.task, "pid": pid, "tid": _THREADS[(run.role, "run")],
                "ts": _us(run.start), "dur": _us(run.end - run.start), "args": {"role": run.role},
            })
        for comm in timeline.comms:
            args = {"task": comm.task, "index": comm.index, "exposed_us": _us(comm.exposed),
                    "in_flight_us": _us(comm.in_flight)}
            events.append({
                "ph": "X", "cat": "comm", "name": f"{comm.task} comm {comm.index}", "pid": pid,
                "tid": _THREADS[(comm.role, "comm")], "ts": _us(comm.issued), "dur": _us(comm.in_flight),
                "args": args,
            })
            events.append({
                "ph": "X", "cat": "exposed", "name": "exposed", "pid": pid, "tid": _THREADS[(comm.role, "run")],
                "ts": _us(comm.wait_start), "dur": _us(comm.exposed), "args": args,
            })
            events.append({
                "ph": "i", "s": "t", "cat": "comm", "name": f"issue {comm.task} comm {comm.index}", "pid": pid,
                "tid": _THREADS[(comm.role, "run")], "ts": _us(comm.issued),
            })
    other = {"schema": "lightning_moe_overlap.timeline/1"}
    if step is not None:
        other["step"] = step
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def write_chrome_trace(path: str | Path, timelines: Iterable[StepTimeline], step: int | None = None) -> Path:
    """Write :func:`chrome_trace` as JSON to ``path`` (parent folders are created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(timelines, step)))
    return path


def timelines_from_trace(trace: Mapping[str, Any]) -> list[StepTimeline]:
    """Read the records back from a trace written by :func:`chrome_trace` (for plotting a saved trace)."""
    by_rank: dict[int, StepTimeline] = {}
    roles = {tid: role for (role, kind), tid in _THREADS.items()}
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or e.get("cat") not in ("compute", "comm"):
            continue
        timeline = by_rank.setdefault(e["pid"], StepTimeline(rank=e["pid"]))
        start, dur = e["ts"] / 1e6, e["dur"] / 1e6
        if e["cat"] == "compute":
            timeline.runs.append(RunSpan(roles[e["tid"]], e["name"], start, start + dur))
        else:
            a = e["args"]
            end = start + dur
            timeline.comms.append(
                CommSpan(roles[e["tid"]], a["task"], a["index"], start, end - a["exposed_us"] / 1e6, end)
            )
    return [by_rank[r] for r in sorted(by_rank)]
