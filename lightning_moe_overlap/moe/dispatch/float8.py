"""FP8 dispatch: the token rows quantised before the all-to-all, the gradients back in high precision.

:func:`float8_all_to_all` is the token dispatch of the all-to-all dispatcher when the experts run in FP8
(``docs/fp8.md``, "FP8 dispatch"). Forward, one comm point as the plain exchange: each row to e4m3 with one float32
scale (rowwise, :func:`~lightning_moe_overlap.fp8.rows.quantize_rows`), the bytes and the scales packed in one
``[N, D + 4]`` uint8 tensor and exchanged in one uneven all-to-all, then (on the receiving rank) regrouped by local
expert when a permutation is given; the result is a :class:`~lightning_moe_overlap.fp8.rows.Float8Rows`, which the
experts' FP8 kernel reads without dequantising. Backward, one comm point: the high-precision gradient of the rows,
un-permuted and sent back by the reverse all-to-all, as the plain dispatch's backward does. Nothing is kept on the
dispatcher: the splits and the permutation live in the autograd context of the call.

Shape legend:
    N: rows sent by this rank   M: rows received   R: the received rows in the experts' order   D: hidden size
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_moe_overlap.fp8.recipes import Float8Recipe
from lightning_moe_overlap.fp8.rows import Float8Rows, pack_rows, quantize_rows, row_recipe, unpack_rows
from lightning_moe_overlap.moe.dispatch.comm import all_to_all_raw
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
    ) -> Float8Rows:
        ctx.output_splits, ctx.input_splits, ctx.group, ctx.runtime = output_splits, input_splits, group, runtime
        ctx.perm_R = perm_R
        q_ND, scale_N1 = quantize_rows(x_ND, recipe)
        packed_MB = all_to_all_raw(pack_rows(q_ND, scale_N1), output_splits, input_splits, group, runtime, grad_enabled)
        if perm_R is not None:
            packed_MB = packed_MB.index_select(0, perm_R)
        q_RD, scale_R1 = unpack_rows(packed_MB, row_recipe(recipe).forward_dtype)
        return Float8Rows(q_RD, scale_R1, x_ND.dtype)

    @staticmethod
    def backward(ctx, g_RD: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        g_MD = g_RD
        if ctx.perm_R is not None:  # back to the receive layout: row perm_R[i] of it is row i here
            g_MD = torch.empty_like(g_RD).index_copy_(0, ctx.perm_R, g_RD)
        g_ND = all_to_all_raw(g_MD.contiguous(), ctx.input_splits, ctx.output_splits, ctx.group, ctx.runtime)
        return g_ND, None, None, None, None, None, None, None


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
    )
