"""The order of the comm-point events, per task: issue, host read, hand-over, resume.

:class:`CommOrder` is a :class:`~lightning_moe_overlap.overlap.observers.CommObserver` that writes every event of
every comm point into the sequence of the task (micro-batch and pass, ``"F0"``, ``"B1"``, ...) that runs it, or of
``"-"`` outside a schedule. Only the baton's holder runs, so the task of an event is the one that last started or
resumed. A task's sequence is its own context's: the partner's events go to the partner's task.

The rule it checks (:meth:`CommOrder.host_reads_before_handoff`): no host read of sizes sits between a comm point's
issue and its hand-over. Such a read would make the context wait for the device (on CUDA, for the whole compute
stream) while it holds the baton, before the partner could queue any compute under the collective in flight
(``docs/overlap.md``, "Host reads and hand-overs"). :meth:`CommOrder.mark` adds an event of the caller's own (a
stage that ran, for instance) to the running task's sequence.

Events: ``"issue"``, ``"handoff"``, ``"resume"``, ``"host_read"`` and the marks; waits are not recorded.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from lightning_moe_overlap.overlap.observers import CommObserver

if TYPE_CHECKING:
    from lightning_moe_overlap.overlap.schedule import Role, Task

OUTSIDE = "-"  # the sequence of the events outside a schedule


class CommOrder(CommObserver):
    """Records the comm-point events of each task in order (module docstring).

    Attributes:
        events: task name -> its events, in the order they happened.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._task: dict[Role, str] = {}  # the task each context runs
        self._running: str = OUTSIDE  # the task of the baton's holder
        self.events: dict[str, list[str]] = {}

    # -- observer hooks ------------------------------------------------------------------------------------------
    def on_task_start(self, task: Task) -> None:
        with self._lock:
            self._task[task.role] = self._running = task.name

    def on_task_end(self, task: Task) -> None:
        with self._lock:
            self._running = OUTSIDE

    def on_issue(self, holder: Role | None) -> None:
        self._record(holder, "issue")

    def on_handoff(self, holder: Role | None) -> None:
        self._record(holder, "handoff")

    def on_resume(self, holder: Role | None) -> None:
        self._record(holder, "resume")

    def on_host_read(self, holder: Role | None) -> None:
        self._record(holder, "host_read")

    def mark(self, event: str) -> None:
        """Add ``event`` to the running task's sequence (or to ``"-"`` outside a schedule)."""
        with self._lock:
            self.events.setdefault(self._running, []).append(event)

    # -- the rule ------------------------------------------------------------------------------------------------
    def host_reads_before_handoff(self) -> list[tuple[str, int]]:
        """``(task, index)`` of every host read that sits between an issue and the next hand-over of its task.

        Only the tasks of a schedule are checked: outside one (``"-"``) a comm point does not hand over.
        """
        found = []
        for task, events in self.events.items():
            if task == OUTSIDE:
                continue
            open_issue = False
            for index, event in enumerate(events):
                if event == "issue":
                    open_issue = True
                elif event in ("handoff", "resume"):
                    open_issue = False
                elif event == "host_read" and open_issue:
                    found.append((task, index))
        return found

    def _record(self, holder: Role | None, event: str) -> None:
        with self._lock:
            task = OUTSIDE if holder is None else self._task.get(holder, OUTSIDE)
            if holder is not None:
                self._running = task
            self.events.setdefault(task, []).append(event)
