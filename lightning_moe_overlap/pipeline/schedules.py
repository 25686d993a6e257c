"""torch's pipeline schedules by name, and the rewrite that turns interleaved 1F1B's steady state into overlapped pairs.

Names (``pipeline_schedule=``) and the torch class each one builds:

==================== ================================== =========================================================
name                 torch class                        stages per rank (``vpp``) / micro-batches ``M``
==================== ================================== =========================================================
``1f1b``             ``Schedule1F1B``                   1
``interleaved_1f1b`` ``ScheduleInterleaved1F1B``        > 1, ``M`` a multiple of ``pp``
``dualpipev``        ``ScheduleDualPipeV``              2 (a V: rank r holds stages r and 2pp-1-r), ``M >= 2pp``
``zero_bubble``      ``ScheduleInterleavedZeroBubble``  > 1, ``M`` a multiple of ``pp``
==================== ================================== =========================================================

With overlap, a pair is a forward task and a backward task of the same rank that run as the engine's two contexts
(an ``OVERLAP_F_B`` action). DualPipeV emits such actions itself. ``1f1b`` with overlap runs on torch's runtime of
actions (``_PipelineScheduleRuntime``) with the paired order of :mod:`.paired_1f1b` (two more micro-batches in
flight per stage boundary, so the steady state is all pairs). Interleaved 1F1B does not pair itself: its steady state
alternates one forward and one full backward, and :func:`overlap_pairs` merges adjacent ``F``, ``B`` (in either
order) into an ``OVERLAP_F_B`` action unless the backward needs the forward (same stage and micro-batch, on the
last stage) or the merge would hold back a send that another rank waits for (torch's own lowering pass says so:
"Malformed compute schedule"). Each rank runs the same forwards and backwards, and the backwards of a stage in
the same order, so gradients accumulate in the same order as in the plain schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from lightning_moe_overlap._compat import torch as torch_compat
from lightning_moe_overlap.config import PIPELINE_SCHEDULES as SCHEDULES
from lightning_moe_overlap.config import default_schedule
from lightning_moe_overlap.moe.router import not_counted
from lightning_moe_overlap.pipeline.paired_1f1b import paired_1f1b_order
from lightning_moe_overlap.step_logs import logs_paused

_CLASSES = {
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "dualpipev": ScheduleDualPipeV,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}
LossFn = Callable[[Any, Any], Any]


def validate_schedule(name: str, *, pp: int, vpp: int, num_microbatches: int, overlap: bool) -> None:
    """Check a schedule against the sizes before any stage or collective is built (the same verdict on every rank).

    Raises:
        ValueError: unknown name; ``vpp`` or ``M`` that the schedule cannot run.
        NotImplementedError: overlap with a schedule that has no pair of a forward and a full backward.
    """
    problems = schedule_problems(name, pp=pp, vpp=vpp, num_microbatches=num_microbatches, overlap=overlap)
    if problems:
        raise problems[0]


def schedule_problems(name: str, *, pp: int, vpp: int, num_microbatches: int, overlap: bool) -> list[Exception]:
    """Every rule of :func:`validate_schedule` that the sizes break, each as the error it raises (none: ``[]``)."""
    if name not in SCHEDULES:
        return [ValueError(
            f"Unknown `pipeline_schedule={name!r}`: the schedules are {', '.join(SCHEDULES)}. Pick one of them "
            f"(`{default_schedule(vpp)}` is the default at vpp={vpp})."
        )]  # fmt: skip
    bad = [
        ValueError(f"`{label}={value!r}`: must be an int >= 1.")
        for label, value in (("pp", pp), ("vpp", vpp), ("num_microbatches", num_microbatches))
        if isinstance(value, bool) or not isinstance(value, int) or value < 1
    ]
    if bad:
        return bad  # type: ignore[return-value]
    return _size_problems(name, pp, vpp, num_microbatches) + _overlap_problems(name, pp, overlap)


def _size_problems(name: str, pp: int, vpp: int, num_microbatches: int) -> list[Exception]:
    """The rules on ``vpp`` and the micro-batch count ``M``."""
    out: list[Exception] = []
    if name == "1f1b" and vpp != 1:
        out.append(ValueError(
            f"`pipeline_schedule='1f1b'` runs one stage per rank, got vpp={vpp}. Use `interleaved_1f1b` (or "
            "`dualpipev` at vpp=2) for virtual stages, or set vpp=1."
        ))  # fmt: skip
    if name == "1f1b" and num_microbatches < pp:
        out.append(ValueError(
            f"`pipeline_schedule='1f1b'` needs at least one micro-batch per stage, got num_microbatches="
            f"{num_microbatches} for pp={pp}. Use num_microbatches >= {pp}."
        ))  # fmt: skip
    if name in ("interleaved_1f1b", "zero_bubble") and vpp < 2:
        out.append(ValueError(
            f"`pipeline_schedule={name!r}` interleaves virtual stages, got vpp={vpp}. Set vpp >= 2, or use "
            "`1f1b` at vpp=1."
        ))  # fmt: skip
    if name in ("interleaved_1f1b", "zero_bubble") and num_microbatches % pp:
        out.append(ValueError(
            f"`pipeline_schedule={name!r}` needs num_microbatches a multiple of pp, got {num_microbatches} "
            f"micro-batches and pp={pp}. Use {_multiple_near(num_microbatches, pp)} micro-batches."
        ))  # fmt: skip
    if name == "dualpipev" and vpp != 2:
        out.append(ValueError(
            f"`pipeline_schedule='dualpipev'` needs exactly two stages per rank (a V), got vpp={vpp}. Set vpp=2."
        ))  # fmt: skip
    if name == "dualpipev" and num_microbatches < 2 * pp:
        out.append(ValueError(
            f"`pipeline_schedule='dualpipev'` needs at least as many micro-batches as stages (pp * vpp = "
            f"{2 * pp}), got {num_microbatches}. Use num_microbatches >= {2 * pp}."
        ))  # fmt: skip
    return out


def _overlap_problems(name: str, pp: int, overlap: bool) -> list[Exception]:
    """The rules on ``overlap``: a schedule with no pair of a forward and a full backward cannot overlap."""
    out: list[Exception] = []
    if overlap and name == "zero_bubble":
        out.append(NotImplementedError(
            "Overlap with `zero_bubble`: its backwards are split into input and weight gradients, so it has no "
            "pair of a forward and a full backward to overlap. Use `interleaved_1f1b` or `dualpipev`, or "
            "overlap=False."
        ))  # fmt: skip
    return out


def _multiple_near(m: int, pp: int) -> str:
    low, high = (m // pp) * pp, (m // pp + 1) * pp
    return f"{low} or {high}" if low else f"{high}"


def stage_indices(name: str, *, pp: int, vpp: int, pp_rank: int) -> list[int]:
    """The stages rank ``pp_rank`` of the pp group holds: ``r, r + pp, ...`` (loop), or ``r, 2pp-1-r`` (V)."""
    if name == "dualpipev":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(vpp)]


LastBackwardHook = Callable[[int], None]  # (stage index): just before the stage's last full backward of the step


@dataclass(frozen=True)
class DeferredWgrad:
    """The experts' queued weight-gradient GEMMs as a stage's weight work (``CommRuntime`` with ``delay_wgrad``):
    ``take`` (torch's ``dw_builder``) takes them off the queue as one call; ``kept()`` is entered around the input
    half of a split backward, whose comm points then leave them queued for its weight half."""

    take: Callable[[], Callable[[], None]]
    kept: Callable[[], AbstractContextManager[None]]


class _Stage(PipelineStage):
    """torch's ``PipelineStage``, telling ``before_last_backward(stage_index)`` just before the step's last full
    backward of the stage (torch's schedules and the overlapped pairs both pass ``last_backward``): the sharded
    modes' early gradient reduction arms the chunk's units there (``parallelize/sharding.py``). A split backward
    (zero-bubble's input half) is never the last one: its weight half lands later, in a separate action. With
    ``deferred_wgrad``, a split backward's input half keeps the experts' GEMMs queued for its weight half."""

    def __init__(self, *args: Any, before_last_backward: LastBackwardHook | None,
                 deferred_wgrad: DeferredWgrad | None, **kwargs: Any) -> None:  # fmt: skip
        super().__init__(*args, dw_builder=None if deferred_wgrad is None else deferred_wgrad.take, **kwargs)
        self.before_last_backward = before_last_backward
        self.deferred_wgrad = deferred_wgrad

    def backward_one_chunk(
        self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True, last_backward: bool = False
    ) -> None:
        if last_backward and full_backward and self.before_last_backward is not None:
            self.before_last_backward(self.stage_index)
        kept = self.deferred_wgrad.kept() if self.deferred_wgrad is not None and not full_backward else nullcontext()
        with kept:
            return super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                              last_backward=last_backward)  # fmt: skip


def build_stages(
    chunks: Sequence[nn.Module], indices: Sequence[int], num_stages: int, group: ProcessGroup, device: Any,
    before_last_backward: LastBackwardHook | None = None, deferred_wgrad: DeferredWgrad | None = None,
) -> list[PipelineStage]:  # fmt: skip
    """One ``PipelineStage`` per local chunk (``chunks[k]`` is stage ``indices[k]``), on the pp ``group``;
    ``before_last_backward(stage_index)``, when given, runs just before each stage's last full backward of a step.

    ``deferred_wgrad`` (with ``delay_wgrad``) gives torch its ``dw_builder``: each stage backward runs whole, the
    experts' weight-gradient GEMMs queued, and takes the GEMMs still queued as its weight work. A full backward runs
    them at its comm points (each all-to-all of the backward hides the GEMMs queued before it) and the rest at its
    end; a split one (zero-bubble, DualPipeV) keeps them all for its weight action (``W``), where they fill the
    pipeline's bubbles. Without it a split backward computes the weight gradients by autograd from saved graph
    nodes, which the experts' queued GEMMs are not."""
    if len(chunks) != len(indices):
        raise ValueError(
            f"`build_stages`: {len(chunks)} chunks for stages {list(indices)}. Pass one chunk per stage this rank "
            "holds (see `stage_indices`)."
        )
    if before_last_backward is None and deferred_wgrad is None:
        return [PipelineStage(chunk, index, num_stages, device, group=group)
                for chunk, index in zip(chunks, indices, strict=True)]  # fmt: skip
    return [
        _Stage(chunk, index, num_stages, device, group=group, before_last_backward=before_last_backward,
               deferred_wgrad=deferred_wgrad)
        for chunk, index in zip(chunks, indices, strict=True)
    ]  # fmt: skip


def build_schedule(
    name: str,
    stages: Sequence[PipelineStage],
    num_microbatches: int,
    loss_fn: LossFn,
    *,
    overlap: bool,
    scale_grads: bool = True,
) -> Any:
    """torch's schedule ``name`` over this rank's ``stages``; with ``overlap``, interleaved 1F1B's order rewritten
    into ``OVERLAP_F_B`` pairs (:func:`overlap_pairs`). ``scale_grads``: torch divides the gradients by
    ``num_microbatches`` after each step (False: ``loss_fn`` weighs the losses itself). Run it through
    :class:`~lightning_moe_overlap.pipeline.executor.PipelineExecutor`, which executes the pairs.

    Raises:
        ValueError, NotImplementedError: see :func:`validate_schedule`.
    """
    pp, vpp = stages[0].group_size, len(stages)
    validate_schedule(name, pp=pp, vpp=vpp, num_microbatches=num_microbatches, overlap=overlap)
    if overlap and name == "1f1b":  # torch's runtime of actions, running the paired order (`paired_1f1b.py`)
        schedule = torch_compat.pipeline_runtime(stages, num_microbatches, loss_fn, scale_grads=scale_grads)
        torch_compat.wrap_pipeline_stage_init(schedule, _metadata_inference)
        torch_compat.relower_pipeline_order(schedule, paired_1f1b_order(pp, num_microbatches))
        return schedule
    stage_arg: Any = stages[0] if name == "1f1b" else list(stages)
    schedule = _CLASSES[name](stage_arg, num_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    torch_compat.wrap_pipeline_stage_init(schedule, _metadata_inference)
    if overlap and name == "interleaved_1f1b":
        torch_compat.relower_pipeline_order(schedule, overlap_pairs(schedule))
    return schedule


@contextmanager
def _metadata_inference() -> Iterator[None]:
    """torch's stage initialisation runs the stages and the loss once to infer shapes: no training forward, so the
    routers' token counters and the step's logs leave it out."""
    with not_counted(), logs_paused():
        yield


def overlap_pairs(schedule: Any) -> dict[int, list[Any]]:
    """The schedule's compute order with each mergeable adjacent ``F``, ``B`` (full backward) of a rank, in either
    order, turned into
    one ``OVERLAP_F_B`` action; greedy, first pair first, each merge kept only if torch's lowering still schedules
    every send and receive. Deterministic: every rank computes the same order. Leaves ``schedule`` as it was."""
    original = {rank: list(actions) for rank, actions in schedule.pipeline_order.items()}
    order = {rank: list(actions) for rank, actions in original.items()}
    try:
        for rank in sorted(order):
            k = 0
            while k < len(order[rank]) - 1:
                merged = _merge_at(order[rank], k)
                if merged is not None and _lowers(schedule, {**order, rank: merged}):
                    order[rank] = merged
                k += 1
    finally:
        torch_compat.relower_pipeline_order(schedule, original)
    return order


def _merge_at(actions: list[Any], k: int) -> list[Any] | None:
    first, second = actions[k], actions[k + 1]
    if first is None or second is None:
        return None
    kinds = (torch_compat.action_kind(first), torch_compat.action_kind(second))
    if kinds not in (("F", "B"), ("B", "F")):
        return None
    fwd, bwd = (first, second) if kinds == ("F", "B") else (second, first)
    if fwd.stage_index == bwd.stage_index and fwd.microbatch_index == bwd.microbatch_index:
        return None  # the backward needs this very forward (its loss)
    pair = torch_compat.pipeline_action(-1, "OVERLAP_F_B", None, (fwd, bwd))
    return [*actions[:k], pair, *actions[k + 2 :]]


def _lowers(schedule: Any, order: dict[int, list[Any]]) -> bool:
    try:
        torch_compat.relower_pipeline_order(schedule, {rank: list(actions) for rank, actions in order.items()})
    except AssertionError:
        return False
    return True


def count_pairs(order: dict[int, list[Any]]) -> dict[int, int]:
    """``OVERLAP_F_B`` actions per rank."""
    return {
        rank: sum(1 for a in actions if a is not None and torch_compat.action_kind(a) == "OVERLAP_F_B")
        for rank, actions in order.items()
    }


def render_order(order: dict[int, list[Any]], ranks: Sequence[int] | None = None) -> str:
    """The compute order as text, one line per rank, one column per time step: ``0F2`` is the forward of
    micro-batch 2 on stage 0, ``2B0`` a full backward, ``0I2`` / ``0W2`` its input / weight halves, ``.`` a
    bubble, and ``0F3|2B1`` an ``OVERLAP_F_B`` pair run as the two contexts."""
    ranks = sorted(order) if ranks is None else list(ranks)
    cells = {rank: [_cell(a) for a in order[rank]] for rank in ranks}
    width = max((len(c) for row in cells.values() for c in row), default=1)
    return "\n".join(f"rank {rank}: " + " ".join(c.ljust(width) for c in cells[rank]).rstrip() for rank in ranks)


def _cell(action: Any) -> str:
    if action is None:
        return "."
    if torch_compat.action_kind(action) == "OVERLAP_F_B":
        return "|".join(_cell(sub) for sub in action.sub_actions)
    return str(action)


def compute_order(name: str, *, pp: int, vpp: int, num_microbatches: int, overlap: bool) -> dict[int, list[Any]]:
    """``{pp rank: compute actions}`` of schedule ``name`` at these sizes, with the overlap as :func:`build_schedule`
    runs it (1F1B's paired order, interleaved 1F1B rewritten into pairs); from stand-in stages, no process group.

    Raises:
        ValueError, NotImplementedError: see :func:`validate_schedule`.
    """
    from types import SimpleNamespace

    validate_schedule(name, pp=pp, vpp=vpp, num_microbatches=num_microbatches, overlap=overlap)
    if overlap and name == "1f1b":
        return paired_1f1b_order(pp, num_microbatches)
    num_stages = pp * vpp
    stages = [
        SimpleNamespace(num_stages=num_stages, group_size=pp, group_rank=0, stage_index=i, submod=None,
                        is_first=i == 0, is_last=i == num_stages - 1)
        for i in stage_indices(name, pp=pp, vpp=vpp, pp_rank=0)
    ]  # fmt: skip
    built = _CLASSES[name](stages[0] if name == "1f1b" else stages, num_microbatches, loss_fn=lambda out, target: out)
    order = overlap_pairs(built) if overlap and name == "interleaved_1f1b" else built.pipeline_order
    return {rank: list(actions) for rank, actions in order.items()}


def docs_orders() -> str:
    """The orders shown in docs/pipeline.md (:func:`compute_order`): interleaved 1F1B rewritten into pairs and
    DualPipeV as torch emits it (pp=2, vpp=2, 4 micro-batches), and 1F1B's paired order at pp=4 with 8 micro-batches
    (:mod:`.paired_1f1b`). Needs no process group."""
    return (
        "interleaved_1f1b, overlap (pp=2, vpp=2, M=4)\n"
        + render_order(compute_order("interleaved_1f1b", pp=2, vpp=2, num_microbatches=4, overlap=True))
        + "\n\ndualpipev (pp=2, vpp=2, M=4)\n"
        + render_order(compute_order("dualpipev", pp=2, vpp=2, num_microbatches=4, overlap=False))
        + "\n\n1f1b, overlap (pp=4, vpp=1, M=8)\n"
        + render_order(compute_order("1f1b", pp=4, vpp=1, num_microbatches=8, overlap=True))
    )
