"""Current scaling: an operand's amax to its scale, and the saturating cast to FP8.

Convention: ``scale`` is the *dequantisation* factor, ``x ~= q * scale`` with ``q`` the FP8 values, which is what
``torch._scaled_mm`` multiplies back in. ``scale = max(amax, EPS) / fp8_max``: the largest entry maps to the top of
the FP8 range; an all-zero operand gets a finite scale and quantises to zeros (never a division by zero). With
``power_of_2_scales`` the scale is rounded *up* to a power of two, so the largest entry still fits. The cast
saturates: values are clamped to ``+-fp8_max`` before the conversion (``float8_e4m3fn`` has no infinity). A
non-finite entry makes its scale non-finite, so the GEMM's output is non-finite too, as the unquantised GEMM's
would be (a loss scaler's overflow check still sees it).

Block scales (``mxfp8``, OCP microscaling): one scale per ``block_size`` consecutive values of a row along ``K``,
``2 ** max(ceil(log2(amax / fp8_max)), -127)``: the block's amax rounded up to the top of the FP8 range, as an e8m0
exponent (whose smallest is ``2 ** -127``; an all-zero block quantises to zeros). That is torchao's ``RCEIL`` rule
(the OCP spec's ``FLOOR`` rule rounds down and saturates the largest values instead). ``K`` must be a multiple of
the block size (:mod:`.gemm` pads it).

Shape legend:
    M: rows of an operand   K: the contraction dim (the last dim here)   B: blocks of a row, ``K / block_size``
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_moe_overlap.float8.recipes import EPS, Float8Recipe, Role

E8M0_MIN_EXPONENT = -127  # the smallest power of two an e8m0 scale holds


def amax_to_scale(amax: Tensor, fp8_dtype: torch.dtype, power_of_2: bool = False) -> Tensor:
    """The float32 dequantisation scale ``max(amax, EPS) / fp8_max`` (rounded up to a power of two on request)."""
    scale = amax.float().clamp(min=EPS) / torch.finfo(fp8_dtype).max
    return torch.exp2(torch.ceil(torch.log2(scale))) if power_of_2 else scale


def block_scales(amax: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    """The float32 e8m0 scales of blocks with absolute maxima ``amax``: ``2 ** max(ceil(log2(amax / fp8_max)),
    -127)`` (a non-finite amax gives a non-finite scale)."""
    exponent = torch.ceil(torch.log2(amax.float() / torch.finfo(fp8_dtype).max))
    return torch.exp2(exponent.clamp(min=E8M0_MIN_EXPONENT))


def quantize_blocks(x_MK: Tensor, block_size: int, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(q_MK, scale_MB)``: ``x_MK`` in ``fp8_dtype`` with one e8m0 scale per ``block_size`` values along ``K``.

    Raises:
        ValueError: ``K`` is not a multiple of ``block_size``.
    """
    m, k = x_MK.shape
    if k % block_size:
        raise ValueError(
            f"`quantize_blocks`: the contraction dim K={k} is not a multiple of block_size={block_size}; MX scales "
            f"cover whole blocks. Pad K to a multiple of {block_size} with zeros first (`fp8_matmul` does)."
        )
    x_MBb = x_MK.float().reshape(m, k // block_size, block_size)
    scale_MB = block_scales(x_MBb.abs().amax(dim=-1), fp8_dtype)
    fp8_max = torch.finfo(fp8_dtype).max
    q_MBb = (x_MBb / scale_MB.unsqueeze(-1)).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    return q_MBb.reshape(m, k), scale_MB


def quantize(x_MK: Tensor, recipe: Float8Recipe, role: Role) -> tuple[Tensor, Tensor]:
    """``(q_MK, scale)``: ``x_MK`` in the recipe's FP8 format for ``role``, contiguous, with its float32 scale.

    The scale is 0-d for tensorwise recipes, ``[M, 1]`` (one per row, over the contraction dim ``K``) for rowwise
    ones and ``[M, K / block_size]`` for block ones (:func:`quantize_blocks`).
    """
    fp8_dtype = recipe.dtype(role)
    if recipe.granularity == "block":
        return quantize_blocks(x_MK, recipe.block_size, fp8_dtype)
    x = x_MK.float()
    if recipe.granularity == "row":
        amax = x.abs().amax(dim=-1, keepdim=True) if x.shape[-1] else x.new_zeros(x.shape[0], 1)
    else:
        amax = x.abs().amax() if x.numel() else x.new_zeros(())
    scale = amax_to_scale(amax, fp8_dtype, recipe.power_of_2_scales)
    fp8_max = torch.finfo(fp8_dtype).max
    q = (x / scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    return q.contiguous(), scale


def dequantize(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``q * scale`` in ``dtype``: what the FP8 values stand for (block scales ``[M, B]`` cover ``K / B`` values
    each)."""
    if scale.dim() and scale.shape[-1] not in (1, q.shape[-1]):
        scale = scale.repeat_interleave(q.shape[-1] // scale.shape[-1], dim=-1)
    return (q.float() * scale).to(dtype)
