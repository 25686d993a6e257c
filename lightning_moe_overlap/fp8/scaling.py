"""Current scaling: an operand's amax to its scale, and the saturating cast to FP8.

Convention: ``scale`` is the *dequantisation* factor, ``x ~= q * scale`` with ``q`` the FP8 values, which is what
``torch._scaled_mm`` multiplies back in. ``scale = max(amax, EPS) / fp8_max``: the largest entry maps to the top of
the FP8 range; an all-zero operand gets a finite scale and quantises to zeros (never a division by zero). With
``power_of_2_scales`` the scale is rounded *up* to a power of two, so the largest entry still fits. The cast
saturates: values are clamped to ``+-fp8_max`` before the conversion (``float8_e4m3fn`` has no infinity). A
non-finite entry makes its scale non-finite, so the GEMM's output is non-finite too, as the unquantised GEMM's
would be (a loss scaler's overflow check still sees it).

Shape legend:
    M: rows of an operand   K: the contraction dim (the last dim here)
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_moe_overlap.fp8.recipes import EPS, Float8Recipe, Role


def amax_to_scale(amax: Tensor, fp8_dtype: torch.dtype, power_of_2: bool = False) -> Tensor:
    """The float32 dequantisation scale ``max(amax, EPS) / fp8_max`` (rounded up to a power of two on request)."""
    scale = amax.float().clamp(min=EPS) / torch.finfo(fp8_dtype).max
    return torch.exp2(torch.ceil(torch.log2(scale))) if power_of_2 else scale


def quantize(x_MK: Tensor, recipe: Float8Recipe, role: Role) -> tuple[Tensor, Tensor]:
    """``(q_MK, scale)``: ``x_MK`` in the recipe's FP8 format for ``role``, contiguous, with its float32 scale.

    The scale is 0-d for tensorwise recipes and ``[M, 1]`` (one per row, over the contraction dim ``K``) for
    rowwise ones.
    """
    fp8_dtype = recipe.dtype(role)
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
    """``q * scale`` in ``dtype``: what the FP8 values stand for."""
    return (q.float() * scale).to(dtype)
