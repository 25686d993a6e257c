"""Autograd-correct collectives over the expert-parallel group, each one a comm point.

Every collective here is issued asynchronously through the runtime's communicator (``communicator.py``:
``torch.distributed``, or a benchmark's loopback), then ``runtime.handoff()`` lets other work run (queued shared
experts, deferred weight gradients, the other micro-batch), then the collective is waited on through
``runtime.wait(work)`` (which reports it to the runtime's observers, a timer for instance). Backward passes
are collectives too and go through the same comm point: the backward of a dispatch-shaped all-to-all is the
combine-shaped one, the backward of an all-gather a reduce-scatter, and so on.

Rules that keep ranks in lockstep:

- a collective is never skipped because of local data: a rank with no tokens sends and receives empty tensors;
- with one rank in the group (``ep=1``, or no group) no communication is issued (unless the communicator stands
  for other ranks: ``Communicator.exchanges``), but ``runtime.handoff()`` is still called exactly once, so the
  sequence of hand-overs is the same for every ``ep``.

``overlap/backward_handoff.py`` is a hand-over with nothing in flight, in the backward only: the experts place one
where the forward has a comm point without a backward twin (the token-count exchange), so that both passes of a
layer hand over equally often (see ``docs/overlap.md``, "Balanced hand-overs").

Shape legend:
    N: rows sent by this rank       M: rows received        D: feature size         G: ranks in the group
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_moe_overlap.overlap.communicator import TORCH, Communicator, group_size
from lightning_moe_overlap.moe.dispatch.host import host_ints
from lightning_moe_overlap.overlap.observers import Waitable
from lightning_moe_overlap.overlap.runtime import CommRuntime

def communicator_of(runtime: CommRuntime | None) -> Communicator:
    """The communicator the runtime was given; ``torch.distributed``'s without one."""
    communicator = None if runtime is None else runtime.communicator
    return TORCH if communicator is None else communicator


def handoff(runtime: CommRuntime | None, grad_enabled: bool | None = None, side_work: bool = True) -> None:
    """Hand over at a comm point, with the caller's grad mode when called from inside an autograd function.

    An autograd function's forward runs with grad disabled, but the work done at a hand-over (a submitted
    shared-expert forward) must build its graph as the layer's caller would have: ``grad_enabled`` restores the
    mode captured before entering the function. ``side_work=False`` (a metadata exchange: token counts, sizes)
    leaves this context's queued side work for its next comm point, one that moves tokens, whose transfer can hide
    it (the queue is the context's own: the partner never runs it, ``overlap/pending.py``).
    """
    if runtime is None:
        return
    if not side_work:
        runtime.hold_side_work()
    if grad_enabled is None:
        runtime.handoff()
        return
    with torch.set_grad_enabled(grad_enabled):
        runtime.handoff()


def wait(runtime: CommRuntime | None, work: Waitable) -> None:
    """Wait for an issued collective, through ``runtime.wait`` (which can time it) when there is a runtime."""
    if runtime is None:
        work.wait()
        return
    runtime.wait(work)


def all_to_all_raw(
    x_ND: Tensor,
    output_splits: Sequence[int],
    input_splits: Sequence[int],
    group: ProcessGroup | None,
    runtime: CommRuntime | None,
    grad_enabled: bool | None = None,
    side_work: bool = True,
) -> Tensor:
    """Uneven ``all_to_all_single`` along dim 0 at a comm point (no autograd); ``side_work``: see :func:`handoff`."""
    return all_to_all_raw_many((x_ND,), output_splits, input_splits, group, runtime, grad_enabled, side_work)[0]


class _Works:
    """Several issued collectives waited on as one (one comm point, one timed wait)."""

    def __init__(self, works: list[Waitable]) -> None:
        self._works = works

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        return True


def all_to_all_raw_many(
    tensors: Sequence[Tensor],
    output_splits: Sequence[int],
    input_splits: Sequence[int],
    group: ProcessGroup | None,
    runtime: CommRuntime | None,
    grad_enabled: bool | None = None,
    side_work: bool = True,
) -> tuple[Tensor, ...]:
    """Uneven all-to-alls of several tensors with the same row splits, issued together at one comm point.

    Each tensor goes in its own ``all_to_all_single`` (they may differ in dtype and row width); all are issued,
    then one hand-over, then one wait for all of them. No autograd.
    """
    communicator = communicator_of(runtime)
    if not communicator.exchanges(group):
        handoff(runtime, grad_enabled, side_work)
        return tuple(tensors)
    observers = () if runtime is None else runtime.observers
    outs, works = [], []
    for x_ND in tensors:
        out_MD = x_ND.new_empty((sum(output_splits), *x_ND.shape[1:]))
        works.append(communicator.all_to_all(out_MD, x_ND.contiguous(), output_splits, input_splits, group))
        if observers:
            row_bytes = x_ND[0].numel() * x_ND.element_size() if x_ND.shape[0] else 0
            sent, remote = sum(input_splits) * row_bytes, communicator.remote_rows(input_splits, group) * row_bytes
            for observer in observers:
                observer.on_traffic(sent, remote)
        outs.append(out_MD)
    handoff(runtime, grad_enabled, side_work)
    wait(runtime, works[0] if len(works) == 1 else _Works(works))
    return tuple(outs)


def all_gather_raw(
    x_ND: Tensor,
    group: ProcessGroup | None,
    runtime: CommRuntime | None,
    grad_enabled: bool | None = None,
    side_work: bool = True,
) -> Tensor:
    """Equal-size all-gather along dim 0 at a comm point (no autograd): ``[G * N, ...]`` in rank order;
    ``side_work``: see :func:`handoff`."""
    size = group_size(group)
    if size == 1:
        handoff(runtime, grad_enabled, side_work)
        return x_ND
    out = x_ND.new_empty((size * x_ND.shape[0], *x_ND.shape[1:]))
    work = communicator_of(runtime).all_gather(out, x_ND.contiguous(), group)
    handoff(runtime, grad_enabled, side_work)
    wait(runtime, work)
    return out


def reduce_scatter_raw(
    x_GND: Tensor, group: ProcessGroup | None, runtime: CommRuntime | None, grad_enabled: bool | None = None
) -> Tensor:
    """Sum-reduce-scatter along dim 0 at a comm point (no autograd): rank ``r`` gets the sum of chunk ``r``."""
    size = group_size(group)
    if size == 1:
        handoff(runtime, grad_enabled)
        return x_GND
    out = x_GND.new_empty((x_GND.shape[0] // size, *x_GND.shape[1:]))
    work = communicator_of(runtime).reduce_scatter(out, x_GND.contiguous(), group)
    handoff(runtime, grad_enabled)
    wait(runtime, work)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        x_ND: Tensor,
        output_splits: tuple[int, ...],
        input_splits: tuple[int, ...],
        group: ProcessGroup | None,
        runtime: CommRuntime | None,
        grad_enabled: bool,
    ) -> Tensor:
        ctx.output_splits, ctx.input_splits, ctx.group, ctx.runtime = output_splits, input_splits, group, runtime
        return all_to_all_raw(x_ND, output_splits, input_splits, group, runtime, grad_enabled)

    @staticmethod
    def backward(ctx, g_MD: Tensor) -> tuple[Tensor, None, None, None, None]:  # type: ignore[override]
        # The reverse exchange: what was received goes back to where it came from.
        g_ND = all_to_all_raw(g_MD.contiguous(), ctx.input_splits, ctx.output_splits, ctx.group, ctx.runtime)
        return g_ND, None, None, None, None, None


class _AllToAllMany(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        output_splits: tuple[int, ...],
        input_splits: tuple[int, ...],
        group: ProcessGroup | None,
        runtime: CommRuntime | None,
        grad_enabled: bool,
        *tensors: Tensor,
    ) -> tuple[Tensor, ...]:
        ctx.output_splits, ctx.input_splits, ctx.group, ctx.runtime = output_splits, input_splits, group, runtime
        ctx.differentiable = tuple(t.is_floating_point() for t in tensors)
        ctx.set_materialize_grads(False)  # unused outputs get ``None``; zeros are made below where needed
        outs = all_to_all_raw_many(tensors, output_splits, input_splits, group, runtime, grad_enabled)
        ctx.mark_non_differentiable(*(o for o, d in zip(outs, ctx.differentiable) if not d))
        ctx.layouts = tuple((o.shape[1:], o.dtype, o.device) for o in outs)
        return outs

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        # The reverse exchange of every floating tensor whose input needs a gradient, at one comm point.
        needs = [i for i, d in enumerate(ctx.differentiable) if d and ctx.needs_input_grad[5 + i]]
        num_rows = sum(ctx.output_splits)
        send = [
            grads[i].contiguous()
            if grads[i] is not None
            else torch.zeros((num_rows, *ctx.layouts[i][0]), dtype=ctx.layouts[i][1], device=ctx.layouts[i][2])
            for i in needs  # an unused output still sends its (zero) rows: every rank takes part
        ]
        back = all_to_all_raw_many(send, ctx.input_splits, ctx.output_splits, ctx.group, ctx.runtime) if send else ()
        out: list[Tensor | None] = [None] * len(ctx.differentiable)
        for i, g in zip(needs, back):
            out[i] = g
        return (None, None, None, None, None, *out)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x_ND: Tensor, group: ProcessGroup | None, runtime: CommRuntime | None, grad_enabled: bool
    ) -> Tensor:
        ctx.group, ctx.runtime = group, runtime
        return all_gather_raw(x_ND, group, runtime, grad_enabled)

    @staticmethod
    def backward(ctx, g_GND: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        return reduce_scatter_raw(g_GND, ctx.group, ctx.runtime), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x_GND: Tensor, group: ProcessGroup | None, runtime: CommRuntime | None, grad_enabled: bool
    ) -> Tensor:
        ctx.group, ctx.runtime = group, runtime
        return reduce_scatter_raw(x_GND, group, runtime, grad_enabled)

    @staticmethod
    def backward(ctx, g_ND: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        return all_gather_raw(g_ND, ctx.group, ctx.runtime), None, None, None


def all_to_all(
    x_ND: Tensor,
    output_splits: Sequence[int],
    input_splits: Sequence[int],
    group: ProcessGroup | None,
    runtime: CommRuntime | None,
) -> Tensor:
    """Differentiable uneven all-to-all: send ``input_splits[r]`` rows to rank ``r``, receive ``output_splits``.

    Its backward is the reverse all-to-all (splits swapped), also at a comm point.
    """
    return _AllToAll.apply(x_ND, tuple(output_splits), tuple(input_splits), group, runtime, torch.is_grad_enabled())


def all_to_all_many(
    tensors: Sequence[Tensor],
    output_splits: Sequence[int],
    input_splits: Sequence[int],
    group: ProcessGroup | None,
    runtime: CommRuntime | None,
) -> tuple[Tensor, ...]:
    """Differentiable uneven all-to-alls of several tensors with the same row splits, at one comm point.

    Floating tensors are differentiable (their backward is one reverse exchange of all their gradients, also at
    one comm point); integer tensors travel as metadata without a gradient.
    """
    return _AllToAllMany.apply(
        tuple(output_splits), tuple(input_splits), group, runtime, torch.is_grad_enabled(), *tensors
    )


def all_gather(x_ND: Tensor, group: ProcessGroup | None, runtime: CommRuntime | None) -> Tensor:
    """Differentiable equal-size all-gather along dim 0; backward is a sum-reduce-scatter."""
    return _AllGather.apply(x_ND, group, runtime, torch.is_grad_enabled())


def reduce_scatter(x_GND: Tensor, group: ProcessGroup | None, runtime: CommRuntime | None) -> Tensor:
    """Differentiable sum-reduce-scatter along dim 0; backward is an all-gather."""
    return _ReduceScatter.apply(x_GND, group, runtime, torch.is_grad_enabled())


def exchange_counts(counts_GE: Tensor, group: ProcessGroup | None, runtime: CommRuntime | None) -> Tensor:
    """All-to-all of per-destination counts ``[G, E]``: returns the counts every source sends here, ``[G, E]``.

    A metadata comm point: its hand-over leaves the queued side work for the token dispatch (:func:`handoff`).
    """
    num_ranks, per_rank = counts_GE.shape
    splits = [per_rank] * num_ranks
    flat = all_to_all_raw(counts_GE.reshape(-1), splits, splits, group, runtime, side_work=False)
    return flat.view(num_ranks, per_rank)


def gather_sizes(
    num_rows: int, group: ProcessGroup | None, runtime: CommRuntime | None, device: torch.device
) -> list[int]:
    """Every rank's ``num_rows`` (an all-gather at a comm point); index = rank in ``group``.

    A metadata comm point: its hand-over leaves the queued side work for the token all-gather (:func:`handoff`).
    """
    mine = torch.full((1,), num_rows, dtype=torch.long, device=device)  # a fill kernel, no host-to-device copy
    sizes = all_gather_raw(mine, group, runtime, side_work=False)
    return host_ints(sizes, runtime)  # NOTE: D2H sync (sizes of the gathered rows), after the hand-over and wait
