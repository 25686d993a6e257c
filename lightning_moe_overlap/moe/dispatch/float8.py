"""FP8 dispatch: the token rows quantised before the all-to-all, the gradients back in high precision.

:func:`float8_all_to_all` is the token dispatch of the all-to-all dispatcher when the experts run in FP8
(``docs/fp8.md``, "FP8 dispatch"). Forward, one comm point as the plain exchange: each row to e4m3 with one float32
scale (rowwise, :func:`~lightning_moe_overlap.float8.rows.quantize_rows`), the bytes and the scales packed in one
``[N, D + 4]`` uint8 tensor and exchanged in one uneven all-to-all, then (on the receiving rank) regrouped by local
expert when a permutation is given; the result is a :class:`~lightning_moe_overlap.float8.rows.Float8Rows`, which the
experts' FP8 kernel reads without dequantising. Backward, one comm point: the high-precision gradient of the rows,
un-permuted and sent back by the reverse all-to-all, as the plain dispatch's backward does. Nothing is kept on the
dispatcher: the splits and the permutation live in the autograd context of the call.

The deduplicated dispatch (``dedup.py``) sends each unique row once, with its routing data in the same comm point:
:func:`float8_all_to_all_many` quantises and packs the rows as above and exchanges the other tensors beside them
(their backward exchange joins the rows' gradient, one comm point), and :func:`gather_float8_rows` then repeats the
received bytes and scales per (row, local expert), as :func:`~lightning_moe_overlap.moe.permute.gather_rows` does
for high-precision rows (its backward adds a row's gradients in the same order).

Shape legend:
    N: rows sent by this rank   M: rows received   R: the received rows in the experts' order   D: hidden size
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_moe_overlap.float8.recipes import Float8Recipe
from lightning_moe_overlap.float8.rows import Float8Rows, pack_rows, quantize_rows, row_recipe, unpack_rows
from lightning_moe_overlap.moe.dispatch.comm import all_to_all_raw_many
from lightning_moe_overlap.moe.permute import sum_rows
from lightning_moe_overlap.overlap.runtime import CommRuntime


class _Float8AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        x_ND: Tensor,
        recipe: Float8Recipe,
        output_splits: tuple[int, ...],
        input_splits: tuple[int, ...],
        group: ProcessGroup | None,
        runtime: CommRuntime | None,
        grad_enabled: bool,
        perm_R: Tensor | None,
        *others_N: Tensor,
    ) -> tuple[Tensor, ...]:
        ctx.output_splits, ctx.input_splits, ctx.group, ctx.runtime = output_splits, input_splits, group, runtime
        ctx.perm_R = perm_R
        ctx.differentiable = tuple(t.is_floating_point() for t in others_N)
        ctx.set_materialize_grads(False)  # unused outputs get ``None``; zeros are made below where needed
        q_ND, scale_N1 = quantize_rows(x_ND, recipe)
        packed = pack_rows(q_ND, scale_N1)
        packed_MB, *others_M = all_to_all_raw_many(
            (packed, *others_N), output_splits, input_splits, group, runtime, grad_enabled
        )
        if perm_R is not None:
            packed_MB = packed_MB.index_select(0, perm_R)
        q_RD, scale_R1 = unpack_rows(packed_MB, row_recipe(recipe).forward_dtype)
        ctx.mark_non_differentiable(*(o for o, d in zip(others_M, ctx.differentiable) if not d))
        ctx.layouts = tuple((o.shape, o.dtype, o.device) for o in (q_RD, *others_M))
        ctx.dtype = x_ND.dtype
        return (Float8Rows(q_RD, scale_R1, x_ND.dtype), *others_M)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx, g_RD: Tensor | None, *grads_M: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        # One reverse exchange: the rows' gradient in high precision, with that of every floating tensor sent
        # beside them whose input needs one (an unused output sends zero rows: every rank takes part).
        if g_RD is None:
            g_RD = torch.zeros(ctx.layouts[0][0], dtype=ctx.dtype, device=ctx.layouts[0][2])
        g_MD = g_RD
        if ctx.perm_R is not None:  # back to the receive layout: row perm_R[i] of it is row i here
            g_MD = torch.empty_like(g_RD).index_copy_(0, ctx.perm_R, g_RD)
        needs = [i for i, d in enumerate(ctx.differentiable) if d and ctx.needs_input_grad[8 + i]]
        send = [g_MD.contiguous()]
        for i in needs:
            shape, dtype, device = ctx.layouts[1 + i]
            g_M = grads_M[i]
            send.append(torch.zeros(shape, dtype=dtype, device=device) if g_M is None else g_M.contiguous())
        g_ND, *back = all_to_all_raw_many(send, ctx.input_splits, ctx.output_splits, ctx.group, ctx.runtime)
        others: list[Tensor | None] = [None] * len(ctx.differentiable)
        for i, g in zip(needs, back):
            others[i] = g
        return g_ND, None, None, None, None, None, None, None, *others


class _GatherFloat8Rows(torch.autograd.Function):
    """The rows ``row_A`` of a :class:`Float8Rows` (their bytes and scales); its backward sums each row's gradients
    slot by slot (:func:`~lightning_moe_overlap.moe.permute.sum_rows`), as the high-precision gather's does."""

    @staticmethod
    def forward(ctx, rows_MD: Float8Rows, row_A: Tensor, max_per_row: int) -> Float8Rows:  # type: ignore[override]
        ctx.save_for_backward(row_A)
        ctx.num_rows, ctx.max_per_row = rows_MD.shape[0], max_per_row
        q_MD = rows_MD.data_fp8
        q_AD = q_MD.view(torch.uint8).index_select(0, row_A).view(q_MD.dtype)  # as bytes: any device indexes them
        return Float8Rows(q_AD, rows_MD.scale.index_select(0, row_A), rows_MD.dtype)

    @staticmethod
    def backward(ctx, g_AD: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        (row_A,) = ctx.saved_tensors
        return sum_rows(g_AD, row_A, ctx.num_rows, ctx.max_per_row), None, None


def float8_all_to_all(
    x_ND: Tensor,
    recipe: Float8Recipe,
    output_splits: tuple[int, ...],
    input_splits: tuple[int, ...],
    group: ProcessGroup | None,
    runtime: CommRuntime | None,
    perm_R: Tensor | None = None,
) -> Float8Rows:
    """The rows ``x_ND`` sent in FP8 (``input_splits[r]`` to rank ``r``), received as :class:`Float8Rows` in the
    order ``perm_R`` of the receive layout (``None``: the receive layout); differentiable, with a high-precision
    backward (see the module docstring)."""
    return _Float8AllToAll.apply(
        x_ND, recipe, tuple(output_splits), tuple(input_splits), group, runtime, torch.is_grad_enabled(), perm_R
    )[0]


def float8_all_to_all_many(
    x_ND: Tensor,
    others_N: tuple[Tensor, ...],
    recipe: Float8Recipe,
    output_splits: tuple[int, ...],
    input_splits: tuple[int, ...],
    group: ProcessGroup | None,
    runtime: CommRuntime | None,
) -> tuple[Tensor, ...]:
    """:func:`float8_all_to_all` of ``x_ND`` (receive layout) with ``others_N`` (the same row splits, any dtype and
    width) exchanged beside it at the same comm point: ``(rows_MD, *others_M)``. Floating ``others_N`` are
    differentiable (their gradients go back with the rows' one, at one comm point); integer ones carry no gradient."""
    return _Float8AllToAll.apply(
        x_ND, recipe, tuple(output_splits), tuple(input_splits), group, runtime, torch.is_grad_enabled(), None,
        *others_N,
    )  # fmt: skip


def gather_float8_rows(rows_MD: Float8Rows, assign_R: Tensor, top_k: int) -> Float8Rows:
    """The received row of each assignment, ``rows_RD[i] = rows_MD[assign_R[i] // K]``, bytes and scales repeated
    (differentiable; the backward sums a row's ``<= K`` gradients without atomics, as ``gather_rows``'s does)."""
    return _GatherFloat8Rows.apply(rows_MD, torch.div(assign_R, top_k, rounding_mode="floor"), top_k)
