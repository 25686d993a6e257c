"""The experts' projections in FP8: per-expert ``torch._scaled_mm`` GEMMs, with a deferrable weight gradient.

:class:`Float8GroupedLinear` is :class:`~lightning_moe_overlap.moe.grouped.GroupedLinear` with its three GEMMs
(forward, dgrad, wgrad) in FP8, and the same contract otherwise: rows sorted by expert or in segments
(:class:`~lightning_moe_overlap.moe.grouped.RowSplits`), weights ``[e, O, I]`` (or ``[e, I, O]`` with
``transposed``), autocast casts the rows and the weight to its dtype first, and the weight gradient goes to
``runtime.defer_wgrad`` (run later, at a comm point, accumulating into the parameter's ``.grad``) or is returned
inline; both run the same kernels in the same order, so ``.grad`` is bitwise equal either way.

The weights stay the high-precision masters (float32 or bfloat16): each GEMM quantises its operands when it runs
(current scaling, :mod:`.scaling`), so parameters, optimizer state and checkpoints do not change. The full-precision
rows and weight are saved for backward (as the bf16 kernel saves them), and quantised there along the backward
GEMMs' own contraction dims, which a rowwise recipe needs.

Rows already in FP8 (:class:`~lightning_moe_overlap.float8.rows.Float8Rows`, from the FP8 dispatch): the forward GEMM
takes their e4m3 values and per-row scales as they are (each weight's scale given per output column), and saves
them, not high-precision rows, for backward; the weight gradient, which contracts over the rows, dequantises them
and quantises them along that dim. With ``rowwise`` the forward is then bitwise the one on high-precision rows
(the same per-row quantisation, done before the exchange).

Each expert's GEMM is its own scaled GEMM: a tensorwise recipe takes one scale per expert's rows and one per
expert's weight; a rowwise recipe one per row along the contraction dim (the weight gradient's contraction runs over
the expert's rows). An expert whose rows come in several segments is gathered first, so segments and sorted rows give
the same numbers. This loop is the reference on every device: it runs on CPU, and on CUDA where ``torch._scaled_mm``
takes FP8 (compute capability >= 8.9). A block recipe (``mxfp8``) scales each 32 values along the contraction dim
(the weight gradient's blocks run over the expert's rows, padded to 32) and emulates its GEMMs (:mod:`.gemm`); its
rows are dispatched in high precision (:attr:`Float8ExpertsKernel.dispatch_recipe` is None), and rows that arrive in
FP8 all the same are dequantised first.

Shape legend:
    R: rows sorted by expert (or in segments)   e: experts held here   I, O: a projection's in/out size   n: rows
    of one expert
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_moe_overlap.float8.gemm import fp8_matmul, fp8_matmul_rows
from lightning_moe_overlap.float8.recipes import Float8Recipe
from lightning_moe_overlap.float8.rows import Float8Rows
from lightning_moe_overlap.float8.scaling import dequantize
from lightning_moe_overlap.moe.grouped import RowSplits, autocast_dtype, leaf_target, weight_gradient
from lightning_moe_overlap.overlap.runtime import CommRuntime

Ranges = list[tuple[int, int]]  # (start row, rows) of one expert's segments, in row order


def expert_ranges(splits: RowSplits) -> list[Ranges]:
    """For each expert, the ``(start, rows)`` of its segments (one for rows sorted by expert; none: no rows)."""
    ranges: list[Ranges] = [[] for _ in range(splits.num_experts)]
    start = 0
    for e, n in splits.segments():
        ranges[e].append((start, n))
        start += n
    return ranges


def _take(x_R: Tensor, ranges: Ranges) -> Tensor:
    if len(ranges) == 1:
        start, n = ranges[0]
        return x_R[start : start + n]
    return torch.cat([x_R[start : start + n] for start, n in ranges])


def _put(y_R: Tensor, ranges: Ranges, y_n: Tensor) -> None:
    offset = 0
    for start, n in ranges:
        y_R[start : start + n].copy_(y_n[offset : offset + n])
        offset += n


def _w_OI(weight: Tensor, e: int, transposed: bool) -> Tensor:
    """Expert ``e``'s weight as ``[O, I]`` (the forward's ``b``: contraction ``I`` last)."""
    return weight[e].t() if transposed else weight[e]


def fp8_forward(x_RI: Tensor, weight: Tensor, splits: RowSplits, transposed: bool, recipe: Float8Recipe) -> Tensor:
    """``y_e = x_e @ W_e^T`` per expert, in FP8, written into one ``[R, O]`` output in ``x_RI``'s dtype."""
    out_features = weight.shape[-1] if transposed else weight.shape[-2]
    y_RO = x_RI.new_empty(x_RI.shape[0], out_features)
    for e, ranges in enumerate(expert_ranges(splits)):
        if ranges:
            y_n = fp8_matmul(_take(x_RI, ranges), _w_OI(weight, e, transposed), recipe, ("input", "weight"), y_RO.dtype)
            _put(y_RO, ranges, y_n)
    return y_RO


def fp8_forward_rows(
    rows: Float8Rows, weight: Tensor, splits: RowSplits, transposed: bool, recipe: Float8Recipe, out_dtype: torch.dtype
) -> Tensor:
    """:func:`fp8_forward` on rows already in FP8 (the FP8 dispatch's): their e4m3 values and per-row scales go into
    the GEMMs as they are, only the weights are quantised here."""
    out_features = weight.shape[-1] if transposed else weight.shape[-2]
    q_RI, scale_R1 = rows.data_fp8, rows.scale
    y_RO = torch.empty(q_RI.shape[0], out_features, dtype=out_dtype, device=q_RI.device)
    for e, ranges in enumerate(expert_ranges(splits)):
        if ranges:
            q_n = _take(q_RI.view(torch.uint8), ranges).view(q_RI.dtype)  # rows of one expert, gathered as bytes
            w_OI = _w_OI(weight, e, transposed)
            _put(y_RO, ranges, fp8_matmul_rows(q_n, _take(scale_R1, ranges), w_OI, recipe, "weight", out_dtype))
    return y_RO


def fp8_dgrad(g_RO: Tensor, weight: Tensor, splits: RowSplits, transposed: bool, recipe: Float8Recipe) -> Tensor:
    """``dx_e = g_e @ W_e`` per expert, in FP8 (contraction over ``O``)."""
    in_features = weight.shape[-2] if transposed else weight.shape[-1]
    dx_RI = g_RO.new_empty(g_RO.shape[0], in_features)
    for e, ranges in enumerate(expert_ranges(splits)):
        if ranges:
            w_IO = _w_OI(weight, e, transposed).t()
            _put(dx_RI, ranges, fp8_matmul(_take(g_RO, ranges), w_IO, recipe, ("grad", "weight"), dx_RI.dtype))
    return dx_RI


def fp8_wgrad(x_RI: Tensor, g_RO: Tensor, splits: RowSplits, transposed: bool, recipe: Float8Recipe) -> Tensor:
    """``dW_e = g_e^T x_e`` (``[e, O, I]``) or ``x_e^T g_e`` (``[e, I, O]``) per expert, in FP8 (contraction over
    the expert's rows); zero for experts with no rows."""
    shape = (splits.num_experts, x_RI.shape[-1], g_RO.shape[-1])
    dw = x_RI.new_empty(shape if transposed else (shape[0], shape[2], shape[1]))
    for e, ranges in enumerate(expert_ranges(splits)):
        if not ranges:
            dw[e].zero_()
            continue
        x_In, g_On = _take(x_RI, ranges).t(), _take(g_RO, ranges).t()
        if transposed:
            dw[e] = fp8_matmul(x_In, g_On, recipe, ("input", "grad"), dw.dtype)
        else:
            dw[e] = fp8_matmul(g_On, x_In, recipe, ("grad", "input"), dw.dtype)
    return dw


class Float8GroupedLinear(torch.autograd.Function):
    """One bias-free FP8 projection per expert, with a deferrable weight gradient (see the module docstring)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        x_RI: Tensor,
        weight: Tensor,
        splits: RowSplits,
        transposed: bool,
        recipe: Float8Recipe,
        runtime: CommRuntime | None,
        grad_target: tuple[Tensor, ...] = (),
    ) -> Tensor:
        dtype = autocast_dtype(x_RI)  # the compute dtype under autocast; None keeps the inputs' dtypes
        w = weight if dtype is None else weight.to(dtype)
        ctx.splits, ctx.transposed, ctx.recipe, ctx.runtime, ctx.dtype = splits, transposed, recipe, runtime, dtype
        ctx.leaf_weight = leaf_target(weight, grad_target)  # where a deferred wgrad accumulates (None: inline)
        if isinstance(x_RI, Float8Rows) and recipe.granularity == "block":  # block GEMMs take no per-row scales
            x_RI = x_RI.dequantized()
        ctx.rows_fp8 = isinstance(x_RI, Float8Rows)
        if ctx.rows_fp8:  # FP8 dispatch: the rows are read, and saved, in FP8 with their scales
            compute_dtype = x_RI.dtype if dtype is None else dtype
            ctx.compute_dtype = compute_dtype
            ctx.save_for_backward(x_RI.data_fp8, x_RI.scale, weight)
            with torch.autocast(x_RI.device.type, enabled=False):
                return fp8_forward_rows(x_RI, w, splits, transposed, recipe, compute_dtype)
        x_RI = x_RI if dtype is None else x_RI.to(dtype)
        ctx.save_for_backward(x_RI, weight)
        with torch.autocast(x_RI.device.type, enabled=False):
            return fp8_forward(x_RI, w, splits, transposed, recipe)

    @staticmethod
    def backward(ctx, g_RO: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        if ctx.rows_fp8:  # the wgrad contracts over the rows: it quantises their values along that dim itself
            q_RI, scale_R1, weight = ctx.saved_tensors
            x_RI = dequantize(q_RI, scale_R1, ctx.compute_dtype)
        else:
            x_RI, weight = ctx.saved_tensors
        splits, transposed, recipe = ctx.splits, ctx.transposed, ctx.recipe
        g_RO = g_RO.to(x_RI.dtype).contiguous()
        device_type = g_RO.device.type
        dx = None
        if ctx.needs_input_grad[0]:
            w = weight if ctx.dtype is None else weight.to(ctx.dtype)
            with torch.autocast(device_type, enabled=False):
                dx = fp8_dgrad(g_RO, w, splits, transposed, recipe)
        if not ctx.needs_input_grad[1]:
            return dx, None, None, None, None, None, None

        dw = weight_gradient(ctx.leaf_weight, ctx.runtime, device_type, weight.dtype,
                             lambda: fp8_wgrad(x_RI, g_RO, splits, transposed, recipe))  # fmt: skip
        return dx, dw, None, None, None, None, None


@dataclass(frozen=True)
class Float8ExpertsKernel:
    """The experts' projection kernel in FP8: what ``Experts.kernel`` / ``ExpertParallelExperts.kernel`` hold
    (``moe/grouped.py``, ``ProjectionKernel``); it takes the same arguments as ``GroupedLinear.apply``. The bf16
    GEMM implementation (``impl``) does not apply to it and is ignored."""

    recipe: Float8Recipe

    @property
    def dispatch_recipe(self) -> Float8Recipe | None:
        """The recipe rows are quantised for when a dispatcher sends them in FP8 (``fp8_dispatch``): this kernel
        reads such rows (:class:`~lightning_moe_overlap.float8.rows.Float8Rows`) without dequantising them. None (a
        high-precision dispatch) for a block recipe (``mxfp8``), whose GEMMs scale blocks, not rows."""
        return None if self.recipe.granularity == "block" else self.recipe

    def __call__(
        self,
        x_RI: Tensor,
        weight: Tensor,
        splits: RowSplits,
        transposed: bool,
        impl: str,
        runtime: CommRuntime | None,
        grad_target: tuple[Tensor, ...] = (),
    ) -> Tensor:
        return Float8GroupedLinear.apply(x_RI, weight, splits, transposed, self.recipe, runtime, grad_target)
