"""Runs one optimizer step of a torch pipeline schedule, each ``OVERLAP_F_B`` action as the overlap engine's pair.

torch's runtime walks this rank's lowered order (compute, send and receive actions). For an ``OVERLAP_F_B`` action
it calls the handler registered here, which does for each sub-action what torch's own ``_perform_action`` does:

1. count the backward (the step's last backward of a stage is marked); the receives the two sub-actions need (the
   forward's activations unless its stage is the first or the previous stage is on this rank, the backward's
   gradients unless its stage is the last or the next one is on this rank) are waited inside each task, as a comm
   point: the task hands the baton to the other one first, which computes while the data is in flight;
2. run the forward sub-action (``forward_one_chunk``, the loss on the last stage, the output handed to a next
   stage on this rank) and the backward sub-action (``backward_one_chunk``, the input gradients handed to a
   previous stage on this rank) as :meth:`~lightning_moe_overlap.overlap.engine.EngineStep.run_pair`: two
   contexts that hand the baton over at every comm point of the chunks (each EP all-to-all), backward first.

3. the sends torch's lowering placed right after the pair (the forward's output to the next stage, the backward's
   input gradients to the previous one) are taken out of its order and issued from inside the pair, as soon as
   the sub-action that produces them has run, in their order (:class:`_PairSends`): a peer waiting for the
   forward's output no longer waits for the pair's backward too. Without it, interleaved 1F1B's rewritten steady
   state makes the pp ranks take turns (each pair needs what the other rank's previous pair sends). The sends'
   works are waited at the end of the step, as torch waits its own.

Every other action (a lone forward or backward, input / weight halves of a split backward, sends after them,
receives, gradient reduction) is torch's own.

With ``overlap=False`` nothing is registered: the schedule runs exactly as torch runs it, the oracle that the
overlapped step must match bitwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from lightning_moe_overlap._compat import torch as torch_compat
from lightning_moe_overlap.overlap.engine import EngineStep, OverlapEngine
from lightning_moe_overlap.overlap.runtime import CommRuntime
from lightning_moe_overlap.overlap.schedule import Role, Task


class PipelineExecutor:
    """One optimizer step of ``schedule`` per :meth:`step`; keep one per training run.

    Args:
        schedule: a schedule from :func:`~lightning_moe_overlap.pipeline.schedules.build_schedule`.
        engine: the overlap engine (its runtime is the one the chunks' comm points hand over through); ``None``
            or ``engine.overlap=False`` runs torch's schedule as it is.

    Raises:
        TypeError: ``engine`` overlaps but the schedule is a single-stage one (no ``OVERLAP_F_B`` actions).
    """

    def __init__(self, schedule: Any, engine: OverlapEngine | None = None) -> None:
        self.schedule = schedule
        self.engine = engine
        self._step: EngineStep | None = None
        self._pair_sends: dict[str, list[Any]] = {}  # str(pair action) -> the sends taken out of torch's order
        self._works: list[Any] = []  # this step's sends issued from inside pairs
        if self.overlap:
            if not hasattr(schedule, "register_custom_function"):
                raise TypeError(
                    f"{type(schedule).__name__} runs one stage per rank and has no OVERLAP_F_B action to overlap. "
                    "Use a multi-stage schedule (`interleaved_1f1b`, `dualpipev`) or an engine with overlap=False."
                )
            torch_compat.register_pipeline_action(schedule, "OVERLAP_F_B", self._overlap_f_b)
            self._take_pair_sends()

    @property
    def overlap(self) -> bool:
        return self.engine is not None and self.engine.overlap

    def step(self, *args: Any, target: Any = None, losses: list | None = None, **kwargs: Any) -> Any:
        """One optimizer step: ``schedule.step(*args, target=..., losses=..., **kwargs)`` (inputs on the rank holding
        the first stage, targets on the one holding the last, ``kwargs`` to every stage; ``losses`` receives the
        per-micro-batch losses there).

        Raises:
            As :meth:`OverlapEngine.run`: a failed task's own exception, or :class:`PeerFailure` when another rank
            failed first.
        """
        if not self.overlap:
            return self.schedule.step(*args, target=target, losses=losses, **kwargs)
        assert self.engine is not None  # noqa: S101 - implied by self.overlap
        with self.engine.step() as engine_step:
            self._step = engine_step
            try:
                output = self.schedule.step(*args, target=target, losses=losses, **kwargs)
                while self._works:
                    self._works.pop(0).wait()
                return output
            except RuntimeError as err:
                if "failed to run forward" not in str(err):
                    raise
                raise _unwrapped(err, "in the forward of a pipeline stage") from None
            finally:
                self._step = None
                self._works = []

    def _take_pair_sends(self) -> None:
        """Move the sends that follow each pair in torch's lowered order into the pair (module docstring, 3)."""
        stages = torch_compat.pipeline_stages(self.schedule)
        rank = stages[0].group_rank
        kept: list[Any] = []
        pair: Any = None
        for action in torch_compat.lowered_pipeline_order(self.schedule)[rank]:
            kind = torch_compat.action_kind(action)
            if kind == "OVERLAP_F_B":
                pair = action
                self._pair_sends[str(action)] = []
            elif pair is not None and kind in ("SEND_F", "SEND_B") and _produced_by(pair, action):
                self._pair_sends[str(pair)].append(action)
                continue
            elif kind not in ("SEND_F", "SEND_B", "RECV_F", "RECV_B"):
                pair = None  # a compute action: the sends after it are its own
            kept.append(action)
        torch_compat.set_lowered_pipeline_actions(self.schedule, rank, kept)

    # -- the OVERLAP_F_B handler -------------------------------------------------------------------------------
    def _overlap_f_b(self, action: Any, ctx: Any) -> None:
        step = self._step
        if step is None:
            raise RuntimeError(
                "An OVERLAP_F_B action ran outside `PipelineExecutor.step`; call `executor.step(...)`, not "
                "`schedule.step(...)`, on a schedule built with overlap."
            )
        forward_action, backward_action = action.sub_actions
        kinds = (torch_compat.action_kind(forward_action), torch_compat.action_kind(backward_action))
        if kinds != ("F", "B"):
            raise NotImplementedError(
                f"OVERLAP_F_B action {action} pairs {kinds[0]} with {kinds[1]}; the pair runs a forward with a full "
                "backward (F, B). Build the schedule with `build_schedule`."
            )
        schedule = ctx.schedule_ref
        stages = {stage.stage_index: stage for stage in torch_compat.pipeline_stages(schedule)}
        sends = _PairSends(stages, self._pair_sends.get(str(action), []), self._works)
        runtime = self.engine.runtime  # the pair's baton is installed in it
        forward_fn = _then(_forward_work(schedule, stages, forward_action, ctx, runtime), sends.ready, "SEND_F")
        backward_fn = _then(_backward_work(schedule, stages, backward_action, runtime), sends.ready, "SEND_B")
        step.run_pair(
            Task(Role.FORWARD, forward_action.microbatch_index, forward_action.stage_index),
            forward_fn,
            Task(Role.BACKWARD, backward_action.microbatch_index, backward_action.stage_index),
            backward_fn,
        )


def _produced_by(pair: Any, send: Any) -> bool:
    """Whether ``send`` sends what a sub-action of ``pair`` produces (same stage and micro-batch, matching kind)."""
    forward, backward = pair.sub_actions
    source = forward if torch_compat.action_kind(send) == "SEND_F" else backward
    return (send.stage_index, send.microbatch_index) == (source.stage_index, source.microbatch_index)


class _PairSends:
    """A pair's sends in torch's order, each issued once the sub-action producing it has run, none before an earlier
    one: point-to-point messages between two ranks are matched in the order they are posted."""

    def __init__(self, stages: dict[int, Any], sends: list[Any], works: list[Any]) -> None:
        self.stages, self.pending, self.works = stages, list(sends), works
        self.done: set[str] = set()

    def ready(self, kind: str) -> None:
        self.done.add(kind)
        while self.pending and torch_compat.action_kind(self.pending[0]) in self.done:
            send = self.pending.pop(0)
            stage, mb = self.stages[send.stage_index], send.microbatch_index
            forward = torch_compat.action_kind(send) == "SEND_F"
            ops = stage.get_fwd_send_ops(mb) if forward else stage.get_bwd_send_ops(mb)
            if ops:
                self.works.extend(dist.batch_isend_irecv(ops))


def _then(work: Callable[[], None], ready: Callable[[str], None], kind: str) -> Callable[[], None]:
    def run() -> None:
        work()
        ready(kind)

    return run


def _forward_work(
    schedule: Any, stages: dict[int, Any], action: Any, ctx: Any, runtime: CommRuntime
) -> Callable[[], None]:
    index, mb = action.stage_index, action.microbatch_index
    stage = stages[index]
    receives = not stage.is_first and index - 1 not in stages
    args = ctx.arg_mbs[mb] if ctx.arg_mbs is not None else ()
    kwargs = ctx.kwarg_mbs[mb] if ctx.kwarg_mbs is not None else {}

    def run() -> None:
        if receives:  # a comm point: the other task computes while the activations are in flight
            runtime.handoff()
            torch_compat.wait_pipeline_recv(schedule, "forward", index, mb)
        try:
            output = stage.forward_one_chunk(mb, args, kwargs)
        except RuntimeError as err:  # torch wraps the model's error as "[Stage i] failed to run forward"
            raise _unwrapped(err, f"in the forward of micro-batch {mb} on pipeline stage {index}") from None
        torch_compat.compute_pipeline_loss(schedule, stage, output, ctx.target_mbs, mb)
        if index + 1 in stages:  # the next stage is on this rank (a V): no send, hand the output over
            stages[index + 1].set_local_fwd_input(output, mb)

    return run


def _backward_work(schedule: Any, stages: dict[int, Any], action: Any, runtime: CommRuntime) -> Callable[[], None]:
    index, mb = action.stage_index, action.microbatch_index
    stage = stages[index]
    receives = not stage.is_last and index + 1 not in stages
    loss = torch_compat.pipeline_loss(schedule, stage, mb)
    last_backward = torch_compat.count_pipeline_backward(schedule, index)

    def run() -> None:
        if receives:  # a comm point: the other task computes while the gradients are in flight
            runtime.handoff()
            torch_compat.wait_pipeline_recv(schedule, "backward", index, mb)
        stage.backward_one_chunk(mb, loss=loss, full_backward=True, last_backward=last_backward)
        if index - 1 in stages:  # the previous stage is on this rank: hand the input gradients over
            stages[index - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)

    return run


def _unwrapped(err: RuntimeError, where: str) -> BaseException:
    """The model's own exception under torch's wrapper (the one other ranks' reports then name), noting ``where``."""
    cause = err.__cause__
    if cause is None:
        return err
    cause.add_note(where)
    return cause
