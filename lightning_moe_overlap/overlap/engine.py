"""The overlap engine: runs one optimizer step's micro-batch schedule as phases of one or two contexts.

Two worker threads ("lanes") live for one step: the forward lane runs ``F0, F1, ...`` and the backward lane
``B0, B1, ...``, one task per phase, in schedule order. Each phase has its own :class:`Baton`, bound in the
:class:`CommRuntime`'s ``phase`` so that every comm point of the model hands over through it. The calling thread
supervises: it hands the tasks of a phase to the lanes, waits for them, reads other ranks' failure reports
meanwhile, and re-raises the first error in its own thread.

Both schedules (overlapped and sequential) run through the same lanes, thread-local state and context factory,
so the sequential run is a faithful oracle: the only difference is which tasks share a phase. With one micro-batch
there is nothing to pair: ``F0`` and ``B0`` run in the calling thread, with the same state, context factory and
failure watch, and no lane is started (:meth:`EngineStep.run_here`).

The unit is a pair of any forward task with any backward task (``schedule.pair``). :meth:`OverlapEngine.run`
drives the pp=1 schedule; :meth:`OverlapEngine.step` hands the same machinery to a schedule driven from outside,
e.g. a pipeline schedule that runs each ``OVERLAP_F_B`` action with :meth:`EngineStep.run_pair`.
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from typing import Any

from lightning_moe_overlap.overlap.baton import Baton
from lightning_moe_overlap.overlap.failures import FailureBoard, FailureWatch
from lightning_moe_overlap.overlap.rng_snapshot import DeviceGenerators, RngSource
from lightning_moe_overlap.overlap.runtime import CommRuntime
from lightning_moe_overlap.overlap.schedule import Phase, Role, Task, build_schedule, pair
from lightning_moe_overlap.overlap.streams import device_max_connections_warning
from lightning_moe_overlap.overlap.thread_state import ThreadState

ForwardFn = Callable[[int], Any]
BackwardFn = Callable[[int, Any], None]
ContextFactory = Callable[[Task], AbstractContextManager[Any]]
TaskBody = Callable[[Task], None]

DEFAULT_TIMEOUT_S = 1800.0  # torch.distributed's default process-group timeout
STALL_FACTOR = 2.0  # a phase without progress for this many `timeout_s` is stuck
LANE_JOIN_S = 5.0  # idle lanes end at once; the bound only guards against a lane stuck in a blocking call


def _no_context(task: Task) -> AbstractContextManager[Any]:
    return nullcontext()


class OverlapEngine:
    """Runs the micro-batch schedule of each optimizer step; keep one per training run.

    Args:
        runtime: the :class:`CommRuntime` the model's comm points call ``handoff()`` on.
        overlap: pair the forward of micro-batch ``i+1`` with the backward of ``i``; else ``F0, B0, F1, B1, ...``.
        context_factory: called with each :class:`Task`; the context manager it returns is entered around that
            task, in the thread that runs it, while the task holds the baton. For thread-local state beyond the
            defaults of ``thread_state.py``, e.g. saved-tensor hooks (``task.role`` tells forward from backward).
        timeout_s: safety net of the internal waits: a context that waits this long for the baton raises
            ``RuntimeError`` naming the phase, and so does a phase without any hand-over for twice as long (a
            single context stuck, with nobody waiting for it). On gloo keep it above the process-group timeout, on
            NCCL at most that (``failures.safety_nets`` gives both).
        stall_timeout_s: how long a phase may go without a hand-over before it counts as stuck; default
            ``2 * timeout_s`` (later than a waiting context's own timeout, which names the stuck context).
        failure_poll_s: how often the engine reads other ranks' failure reports from the c10d store during a step.
        namespace: c10d-store key prefix for failure reports; identical on every rank of a run.
        generators: the device generators the contexts' random streams are kept in (``torch.cuda`` by default; see
            ``rng_snapshot.py``). The device is the current device of the thread that calls :meth:`run`.
    """

    def __init__(
        self,
        runtime: CommRuntime,
        *,
        overlap: bool = True,
        context_factory: ContextFactory | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        stall_timeout_s: float | None = None,
        failure_poll_s: float = 1.0,
        namespace: str = "lightning_moe_overlap",
        generators: DeviceGenerators | None = None,
    ) -> None:
        stall_timeout_s = STALL_FACTOR * timeout_s if stall_timeout_s is None else stall_timeout_s
        for name, value in (
            ("timeout_s", timeout_s), ("stall_timeout_s", stall_timeout_s), ("failure_poll_s", failure_poll_s)
        ):
            if not value > 0:
                raise ValueError(f"`OverlapEngine({name}={value})`: must be > 0 seconds.")
        self.runtime = runtime
        self.overlap = overlap
        self.context_factory = context_factory or _no_context
        self.timeout_s = float(timeout_s)
        self.stall_timeout_s = float(stall_timeout_s)
        self.failure_poll_s = float(failure_poll_s)
        self.namespace = namespace
        self.generators = generators
        self._steps = 0
        self._board: FailureBoard | None = None

    def run(self, forward_fn: ForwardFn, backward_fn: BackwardFn, num_microbatches: int) -> list[Any]:
        """Run one step: every micro-batch's forward and backward, overlapped or not.

        Args:
            forward_fn: ``forward_fn(i)`` runs micro-batch ``i``'s forward and returns its output (e.g. the loss).
            backward_fn: ``backward_fn(i, output)`` runs its backward (e.g. ``output.backward()``).
            num_microbatches: ``M >= 1``.

        Returns:
            The outputs of ``forward_fn``, in micro-batch order. Every delayed weight gradient has landed in
            ``.grad`` (flushed after each backward, in micro-batch order).

        Raises:
            The original exception of a failed task, with its traceback; :class:`PeerFailure` when another rank
            failed first; ``RuntimeError`` when a safety-net timeout expires.
        """
        phases = build_schedule(num_microbatches, overlap=self.overlap)
        outputs: list[Any] = [None] * num_microbatches

        def body(task: Task) -> None:
            i = task.microbatch
            if task.role is Role.FORWARD:
                outputs[i] = forward_fn(i)
            else:
                backward_fn(i, outputs[i])

        with self.step(_stacklevel=5) as step:
            for phase in phases:
                if num_microbatches == 1:  # F0, B0: nothing to pair, so no lanes (see `EngineStep.run_here`)
                    step.run_here(phase.tasks[0], body)
                else:
                    step.run_phase(phase, body)
        return outputs

    @contextmanager
    def step(self, *, _stacklevel: int = 4) -> Iterator[EngineStep]:
        """One optimizer step of a schedule driven from outside (a pipeline schedule's actions), as a block.

        Inside the block, :meth:`EngineStep.run_pair` runs a forward task and a backward task as the two contexts
        that hand the baton over at every comm point, and :meth:`EngineStep.run_task` runs one task alone; both
        in the step's lanes, with the calling thread's state, random streams and failure watch: the machinery of
        :meth:`run`, which is this block around the pp=1 phases.

        Raises:
            As :meth:`run`: an exception leaving the block becomes a :class:`PeerFailure` when another rank failed
            first, and is reported to the other ranks when this rank failed first.
        """
        self._warn_if_overlap_cannot_work(_stacklevel)
        watch = self._next_watch()
        step = EngineStep(self, watch, ThreadState.capture(), RngSource.of_current_thread(self.generators))
        try:
            yield step
        except BaseException as err:
            raise watch.explain(err)  # noqa: B904 - `explain` returns `err` itself or a PeerFailure chained from it
        finally:
            step.close()

    # -- supervision ---------------------------------------------------------------------------------------------
    def _supervise(self, baton: Baton, watch: FailureWatch) -> bool:
        """Wait until the phase's contexts finished (True); stop them when another rank failed; return False when
        the phase made no progress for ``stall_timeout_s``."""
        progress, since = baton.progress, time.monotonic()
        suspect = False  # the holder was in autograd at the last poll, with no hand-over since
        while not baton.wait_done(min(self.failure_poll_s, self.timeout_s)):
            if watch.poll() is not None:
                baton.abort()
            now = time.monotonic()
            if baton.progress != progress:
                progress, since, suspect = baton.progress, now, False
            elif now - since > self.stall_timeout_s:
                return False
            else:
                stuck = baton.autograd_stuck()
                if stuck is not None and suspect and not baton.stopped:
                    baton.fail(_autograd_in_context_error(baton.phase, stuck))
                suspect = stuck is not None
        return True

    # -- helpers -----------------------------------------------------------------------------------------------------
    def _next_watch(self) -> FailureWatch:
        if self._board is None:
            self._board = FailureBoard.for_default_group(self.namespace, poll_s=self.failure_poll_s)
        self._steps += 1
        return FailureWatch(self._board, self._steps)

    def _warn_if_overlap_cannot_work(self, stacklevel: int) -> None:
        message = device_max_connections_warning() if self.overlap else None
        if message is not None:
            warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)


def _autograd_in_context_error(phase: str, role: Role) -> RuntimeError:
    return RuntimeError(
        f"Phase {phase}: the {role.value} context called torch.autograd.grad/backward (e.g. a gradient penalty) "
        f"while the {role.partner.value} context waits at a comm point inside autograd's device thread. On CUDA "
        "autograd runs every backward function of a device on that one thread, so the call waits for it, and it "
        "waits for the baton: both would hang until the process-group timeout. A forward the overlap pairs with a "
        "backward must not run autograd itself. Set `overlap=False` for this model (each task then runs alone), "
        "or move the autograd call out of the micro-batch's forward."
    )


def run_schedule(
    forward_fn: ForwardFn,
    backward_fn: BackwardFn,
    num_microbatches: int,
    runtime: CommRuntime,
    *,
    overlap: bool,
    context_factory: ContextFactory | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[Any]:
    """One step with a one-off :class:`OverlapEngine` (see :meth:`OverlapEngine.run`).

    A training loop should keep one engine instead: its failure reports are keyed by step, while one-off engines
    all use step 1, so a report left by an earlier failed step in the same process group would be read again.
    """
    engine = OverlapEngine(runtime, overlap=overlap, context_factory=context_factory, timeout_s=timeout_s)
    return engine.run(forward_fn, backward_fn, num_microbatches)


class EngineStep:
    """One step of an :class:`OverlapEngine` (see :meth:`OverlapEngine.step`).

    It owns the lanes, one worker thread per role that lives for the step, the thread state and random generators
    of the thread that started the step, and the step's failure watch. Phases run one at a time, each with its own
    :class:`Baton` bound in the runtime; the calling thread supervises each.
    """

    def __init__(self, engine: OverlapEngine, watch: FailureWatch, state: ThreadState, rng: RngSource) -> None:
        self.engine = engine
        self.watch = watch
        self.state = state
        self.rng = rng  # fixed in the calling thread: lanes are new threads whose current device is not the step's
        self.settled = True  # False once a phase stalled: its lanes may be stuck
        self._lanes: dict[Role, _Lane] = {}

    def run_pair(
        self, forward_task: Task, forward_fn: Callable[[], Any], backward_task: Task, backward_fn: Callable[[], Any]
    ) -> None:
        """Run ``forward_fn`` as ``forward_task`` and ``backward_fn`` as ``backward_task``: any forward with any
        backward (e.g. a pipeline's ``OVERLAP_F_B`` action). When the engine overlaps, they are the two contexts
        of one phase, the backward holding the baton first; otherwise they run one after the other, forward
        first, in the same lanes (the oracle order)."""
        bodies = {forward_task: forward_fn, backward_task: backward_fn}

        def body(task: Task) -> None:
            bodies[task]()

        if self.engine.overlap:
            self.run_phase(pair(forward_task, backward_task), body)
        else:
            self.run_phase(Phase((forward_task,)), body)
            self.run_phase(Phase((backward_task,)), body)

    def run_task(self, task: Task, fn: Callable[[], Any]) -> None:
        """Run ``fn`` as ``task``, alone in its phase (its comm points do not hand over)."""
        self.run_phase(Phase((task,)), lambda _: fn())

    def run_here(self, task: Task, body: TaskBody) -> None:
        """Run ``task`` alone in the calling thread, as a one-context phase would (its hand-overs return at once).

        For a step with nothing to pair (one micro-batch): no lane thread. Besides the hand-over, a lane costs
        memory traffic on CPU: the C allocator gives each new thread its own arena, so a lane allocates the step's
        activations afresh (a page fault on every new page) where the calling thread reuses its own memory; at 1536
        tokens per call that cost up to a third of the step. What a task sees is the same: the context factory,
        the thread state, the delayed weight gradients flushed after a backward, the failure watch of the step.
        A peer's failure is read when this task's collective fails, not polled while it runs, and a stuck task is
        ended by the process group's timeout rather than the engine's stall detector.
        """
        engine = self.engine
        baton = Baton((task.role,), phase=task.name, starter=task.role, timeout_s=engine.timeout_s, rng=self.rng)
        with engine.runtime.phase.bound(baton):  # one context: its hand-overs return at once
            self._execute(task, body)

    def run_phase(self, phase: Phase, body: TaskBody) -> None:
        """Run the tasks of ``phase``; ``body(task)`` does each one's work, in that task's lane."""
        engine = self.engine
        baton = Baton(phase.roles, phase=phase.name, starter=phase.starter, timeout_s=engine.timeout_s, rng=self.rng)
        with engine.runtime.phase.bound(baton):
            for task in phase.tasks:
                self._lane(task.role).submit(partial(baton.run, task.role, partial(self._execute, task, body)))
            done = False
            try:
                done = engine._supervise(baton, self.watch)
            finally:
                if not done:  # stalled, or KeyboardInterrupt in this thread: stop the contexts before unbinding
                    baton.abort()
                    self.settled = baton.wait_done(min(LANE_JOIN_S, engine.timeout_s))
        if baton.errors:
            raise baton.errors[0]
        if not done:
            raise RuntimeError(
                f"Phase {phase.name} made no progress (no hand-over) for {engine.stall_timeout_s:g} s; a "
                "context is stuck. If one compute segment between two comm points can take this long, raise "
                "`timeout_s`."
            )
        if baton.stopped:
            raise self.watch.peer_failure()
        baton.continue_rng_from(Role.FORWARD)

    def close(self) -> None:
        """Stop and join the lanes (without waiting when a phase stalled: they may be stuck)."""
        _close(list(self._lanes.values()), LANE_JOIN_S if self.settled else 0.0)
        self._lanes.clear()

    def _lane(self, role: Role) -> _Lane:
        lane = self._lanes.get(role)
        if lane is None:
            lane = self._lanes[role] = _Lane(role)
        return lane

    def _execute(self, task: Task, body: TaskBody) -> None:
        runtime = self.engine.runtime
        observers = runtime.observers  # e.g. the timeline of a traced step (overlap/timeline.py); usually none
        for observer in observers:
            observer.on_task_start(task)
        try:
            with self.state.applied(), self.engine.context_factory(task):
                body(task)
                runtime.run_side_work()  # what this task left queued runs in it, not in its role's next task
                if task.role is Role.BACKWARD:
                    runtime.flush_wgrad()  # this task's weight gradients land before the next backward
        finally:
            for observer in observers:
                observer.on_task_end(task)


def _close(lanes: Iterable[_Lane], timeout_s: float) -> None:
    """Stop and join the lanes. One stuck in a blocking call (a stalled phase) is a daemon thread left behind: the
    runtime is unbound by then, so if that call ever returns, the context finishes its task without hand-overs."""
    for lane in lanes:
        lane.stop()
    deadline = time.monotonic() + timeout_s
    for lane in lanes:
        lane.join(deadline - time.monotonic())


class _Lane:
    """A worker thread that runs one role's tasks of a step, in order. Jobs never raise (the baton catches)."""

    def __init__(self, role: Role) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"moe-overlap-{role.value}", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def stop(self) -> None:
        """End after the queued jobs."""
        self._jobs.put(None)

    def join(self, timeout_s: float) -> None:
        self._thread.join(max(0.0, timeout_s))

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()
