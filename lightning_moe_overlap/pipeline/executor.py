"""Runs one optimizer step of a torch pipeline schedule, each ``OVERLAP_F_B`` action as the overlap engine's pair.

torch's runtime walks this rank's lowered order (compute, send and receive actions). For an ``OVERLAP_F_B`` action
it calls the handler registered here, which does for each sub-action what torch's own ``_perform_action`` does:

1. in the calling thread, wait for the receives the two sub-actions need (the forward's activations unless its
   stage is the first or the previous stage is on this rank, the backward's gradients unless its stage is the
   last or the next one is on this rank) and count the backward (the step's last backward of a stage is marked);
2. run the forward sub-action (``forward_one_chunk``, the loss on the last stage, the output handed to a next
   stage on this rank) and the backward sub-action (``backward_one_chunk``, the input gradients handed to a
   previous stage on this rank) as :meth:`~lightning_moe_overlap.overlap.engine.EngineStep.run_pair`: two
   contexts that hand the baton over at every comm point of the chunks (each EP all-to-all), backward first.

Sends stay separate actions of torch's order, after the pair. Every other action (a lone forward or backward,
input / weight halves of a split backward, sends, receives, gradient reduction) is torch's own.

With ``overlap=False`` nothing is registered: the schedule runs exactly as torch runs it, the oracle that the
overlapped step must match bitwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_moe_overlap._compat import torch as torch_compat
from lightning_moe_overlap.overlap.engine import EngineStep, OverlapEngine
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
        if self.overlap:
            if not hasattr(schedule, "register_custom_function"):
                raise TypeError(
                    f"{type(schedule).__name__} runs one stage per rank and has no OVERLAP_F_B action to overlap. "
                    "Use a multi-stage schedule (`interleaved_1f1b`, `dualpipev`) or an engine with overlap=False."
                )
            torch_compat.register_pipeline_action(schedule, "OVERLAP_F_B", self._overlap_f_b)

    @property
    def overlap(self) -> bool:
        return self.engine is not None and self.engine.overlap

    def step(self, *args: Any, target: Any = None, losses: list | None = None) -> Any:
        """One optimizer step: ``schedule.step(*args, target=..., losses=...)`` (inputs on the rank holding the
        first stage, targets on the one holding the last; ``losses`` receives the per-micro-batch losses there).

        Raises:
            As :meth:`OverlapEngine.run`: a failed task's own exception, or :class:`PeerFailure` when another rank
            failed first.
        """
        if not self.overlap:
            return self.schedule.step(*args, target=target, losses=losses)
        assert self.engine is not None  # noqa: S101 - implied by self.overlap
        with self.engine.step() as engine_step:
            self._step = engine_step
            try:
                return self.schedule.step(*args, target=target, losses=losses)
            except RuntimeError as err:
                if "failed to run forward" not in str(err):
                    raise
                raise _unwrapped(err, "in the forward of a pipeline stage") from None
            finally:
                self._step = None

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
        forward_fn = _forward_work(schedule, stages, forward_action, ctx)
        backward_fn = _backward_work(schedule, stages, backward_action)
        step.run_pair(
            Task(Role.FORWARD, forward_action.microbatch_index, forward_action.stage_index),
            forward_fn,
            Task(Role.BACKWARD, backward_action.microbatch_index, backward_action.stage_index),
            backward_fn,
        )


def _forward_work(schedule: Any, stages: dict[int, Any], action: Any, ctx: Any) -> Callable[[], None]:
    index, mb = action.stage_index, action.microbatch_index
    stage = stages[index]
    if not stage.is_first and index - 1 not in stages:
        torch_compat.wait_pipeline_recv(schedule, "forward", index, mb)
    args = ctx.arg_mbs[mb] if ctx.arg_mbs is not None else ()
    kwargs = ctx.kwarg_mbs[mb] if ctx.kwarg_mbs is not None else {}

    def run() -> None:
        try:
            output = stage.forward_one_chunk(mb, args, kwargs)
        except RuntimeError as err:  # torch wraps the model's error as "[Stage i] failed to run forward"
            raise _unwrapped(err, f"in the forward of micro-batch {mb} on pipeline stage {index}") from None
        torch_compat.compute_pipeline_loss(schedule, stage, output, ctx.target_mbs, mb)
        if index + 1 in stages:  # the next stage is on this rank (a V): no send, hand the output over
            stages[index + 1].set_local_fwd_input(output, mb)

    return run


def _backward_work(schedule: Any, stages: dict[int, Any], action: Any) -> Callable[[], None]:
    index, mb = action.stage_index, action.microbatch_index
    stage = stages[index]
    if not stage.is_last and index + 1 not in stages:
        torch_compat.wait_pipeline_recv(schedule, "backward", index, mb)
    loss = torch_compat.pipeline_loss(schedule, stage, mb)
    last_backward = torch_compat.count_pipeline_backward(schedule, index)

    def run() -> None:
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
