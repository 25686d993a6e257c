"""One FP8 GEMM of two high-precision operands: quantise each (current scaling), then ``torch._scaled_mm``.

Both operands are given with the contraction dim last, ``a [M, K]`` and ``b [N, K]``, and the result is
``a @ b.T`` ``[M, N]``: so a row of either operand is exactly what a rowwise scale covers, and the quantised ``b``
transposed is the column-major right operand the kernel wants. A contraction dim that is not a multiple of 16 (the
weight gradient's, which runs over an expert's token rows) is padded with zeros, which add nothing to the products
and do not move a row's amax; CUDA's kernel requires the multiple, and CPU then computes the same thing.

Block recipes (``mxfp8``): ``K`` is padded to a multiple of the block size instead (a partial last block keeps its
amax), both operands are quantised per block, and the GEMM is emulated: it runs in float32 on the dequantised
values, on every device (the MX tensor cores of Blackwell GPUs are not used), then writes ``out_dtype``. Every
product is that of the FP8 values and their scales, as an MX GEMM computes it; only the accumulation order may
differ from a hardware kernel's.

Shape legend:
    M, N: output rows and columns   K: the contraction dim
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_moe_overlap._compat import torch as torch_compat
from lightning_moe_overlap.float8.recipes import Float8Recipe, Role
from lightning_moe_overlap.float8.scaling import dequantize, quantize

ALIGN = 16  # the FP8 kernels' multiple for the contraction and output dims (CUDA); K is padded to it here
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fp8_matmul(
    a_MK: Tensor,
    b_NK: Tensor,
    recipe: Float8Recipe,
    roles: tuple[Role, Role],
    out_dtype: torch.dtype,
) -> Tensor:
    """``a_MK @ b_NK.T`` with both operands cast to FP8 by ``recipe`` (``roles`` picks each one's format).

    Raises:
        TypeError: ``out_dtype`` is not float32, bfloat16 or float16 (what the FP8 kernels write).
    """
    if out_dtype not in OUT_DTYPES:
        raise TypeError(
            f"`fp8_matmul`: out_dtype={out_dtype} is not one the FP8 kernels write; the rule is one of "
            f"{[str(d) for d in OUT_DTYPES]}. Train in float32 or bfloat16 (FP8 replaces the GEMMs, not the masters)."
        )
    pad = -a_MK.shape[-1] % (recipe.block_size if recipe.granularity == "block" else ALIGN)
    if pad:
        a_MK, b_NK = F.pad(a_MK, (0, pad)), F.pad(b_NK, (0, pad))
    qa, scale_a = quantize(a_MK, recipe, roles[0])
    qb, scale_b = quantize(b_NK, recipe, roles[1])
    if recipe.granularity == "block":  # emulated MX GEMM: float32 on the dequantised blocks
        return (dequantize(qa, scale_a) @ dequantize(qb, scale_b).t()).to(out_dtype)
    if recipe.granularity == "row":
        scale_b = scale_b.t()  # [1, N]: one scale per output column
    return torch_compat.scaled_mm(qa, qb.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


def fp8_matmul_rows(
    qa_MK: Tensor, scale_a_M1: Tensor, b_NK: Tensor, recipe: Float8Recipe, role_b: Role, out_dtype: torch.dtype
) -> Tensor:
    """``a @ b_NK.T`` where ``a`` is already FP8 with one scale per row (``qa_MK``, ``scale_a_M1``: the FP8
    dispatch's rows) and ``b_NK`` is cast by ``recipe``; its scale is given per output column either way (a
    tensorwise scale repeated ``N`` times), which is what a GEMM with row-scaled ``a`` takes.

    Raises:
        TypeError: ``out_dtype`` is not float32, bfloat16 or float16.
        ValueError: a block recipe (``mxfp8``), whose GEMMs take no row-scaled operand (its rows are dispatched in
            high precision).
    """
    if recipe.granularity == "block":
        raise ValueError(
            f"`fp8_matmul_rows`: recipe {recipe.name!r} scales blocks of {recipe.block_size} values, not rows, so its "
            "GEMMs take no rows already in FP8 with one scale per row. Dequantise the rows and call `fp8_matmul`."
        )
    if out_dtype not in OUT_DTYPES:
        raise TypeError(
            f"`fp8_matmul_rows`: out_dtype={out_dtype} is not one the FP8 kernels write; the rule is one of "
            f"{[str(d) for d in OUT_DTYPES]}. Train in float32 or bfloat16 (FP8 replaces the GEMMs, not the masters)."
        )
    pad = -qa_MK.shape[-1] % ALIGN
    if pad:  # zero bytes are +0.0 in every FP8 format
        qa_MK = F.pad(qa_MK.view(torch.uint8), (0, pad)).view(qa_MK.dtype)
        b_NK = F.pad(b_NK, (0, pad))
    qb, scale_b = quantize(b_NK, recipe, role_b)
    scale_b_1N = scale_b.reshape(-1, 1).expand(b_NK.shape[0], 1).t().contiguous()
    return torch_compat.scaled_mm(qa_MK, qb.t(), scale_a=scale_a_M1, scale_b=scale_b_1N, out_dtype=out_dtype)
