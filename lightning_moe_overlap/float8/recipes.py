"""FP8 training recipes as data: which FP8 format each GEMM operand takes, and how its scale is chosen.

Three recipes run here, on every device, with *current* (dynamic) scaling: each operand is scaled from its own
absolute maximum (amax) at the moment it is cast, so no amax history is kept between steps.

- ``tensorwise``: one scale per tensor (per expert's slice for the experts). Forward operands (activations,
  weights) in ``float8_e4m3fn`` (3 mantissa bits, range +-448); gradients in ``float8_e5m2`` (2 mantissa bits,
  range +-57344). Why e5m2 for gradients: with one scale for a whole tensor, the scale is set by the largest entry,
  and gradients spread over many more orders of magnitude than activations or weights do; e5m2's extra exponent
  bit keeps the small entries from flushing to zero, which costs more than its lost mantissa bit.
- ``rowwise``: one scale per row of each GEMM operand along the contraction dimension, scales rounded up to a power
  of two (a scale then changes only the exponent: no rounding of its own). Every operand, gradients included, in
  ``float8_e4m3fn``. Why e4m3 for gradients here: a per-row scale already follows the range of each row, so the
  extra mantissa bit is worth more than the exponent bit (DeepSeek-V3's fine-grained recipe makes the same choice).
- ``mxfp8`` (OCP microscaling): one power-of-two scale (an e8m0 exponent) per block of 32 consecutive values along
  the contraction dimension, for every operand of every GEMM, all in ``float8_e4m3fn``. The scale follows the range
  of 32 values rather than of a whole row. No GPU before Blackwell has MX tensor cores, so here each GEMM is
  emulated: the operands are quantised per block and the GEMM runs on their dequantised values (what torchao's
  emulated MX kernels do).

``tensorwise`` and ``rowwise`` are torchao's ``Float8LinearConfig`` recipes of the same names, and ``mxfp8`` is
torchao's MXFP8 training recipe (``RCEIL`` scales), so dense linears (torchao) and the experts
(``fp8/experts_kernel.py``) quantise alike. One more name is known and refused with the rule: ``delayed`` (scales
from an amax history, Transformer Engine's default), which needs Transformer Engine on a CUDA GPU and is not wired here yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Granularity = Literal["tensor", "row", "block"]
# the names `MoEOverlapStrategy(fp8=...)` takes (LightningCLI reads them)
FP8Recipe = Literal["tensorwise", "rowwise", "mxfp8"]
Role = Literal["input", "weight", "grad"]

EPS = 1e-12  # the smallest amax a scale is computed from: an all-zero tensor gets a finite scale and quantises to 0
MX_BLOCK = 32  # OCP MX: the values that share one scale, consecutive along the contraction dim


@dataclass(frozen=True)
class Float8Recipe:
    """How the operands of one FP8 GEMM are cast.

    Args:
        name: the recipe's name (``tensorwise``, ``rowwise`` or ``mxfp8``).
        granularity: ``"tensor"`` (one scale per operand), ``"row"`` (one per row along the contraction dim) or
            ``"block"`` (one per ``block_size`` consecutive values of a row along the contraction dim).
        forward_dtype: the FP8 format of activations and weights.
        grad_dtype: the FP8 format of the output gradients (backward GEMMs).
        power_of_2_scales: round each scale up to a power of two.
        block_size: the values sharing one scale with ``"block"`` granularity (0 otherwise).
    """

    name: str
    granularity: Granularity
    forward_dtype: torch.dtype
    grad_dtype: torch.dtype
    power_of_2_scales: bool
    block_size: int = 0

    def dtype(self, role: Role) -> torch.dtype:
        """The FP8 format of an operand in ``role`` (``"input"``, ``"weight"`` or ``"grad"``)."""
        return self.grad_dtype if role == "grad" else self.forward_dtype


RECIPES: dict[str, Float8Recipe] = {
    "tensorwise": Float8Recipe("tensorwise", "tensor", torch.float8_e4m3fn, torch.float8_e5m2, False),
    "rowwise": Float8Recipe("rowwise", "row", torch.float8_e4m3fn, torch.float8_e4m3fn, True),
    "mxfp8": Float8Recipe("mxfp8", "block", torch.float8_e4m3fn, torch.float8_e4m3fn, True, block_size=MX_BLOCK),
}

# Known recipes this package does not run, and what they need.
NEEDS_TE: dict[str, str] = {
    "delayed": "delayed scaling (scales from an amax history kept across steps)",
}


def resolve_recipe(recipe: str | Float8Recipe, device: torch.device | str = "cpu") -> Float8Recipe:
    """The :class:`Float8Recipe` named ``recipe`` (or ``recipe`` itself) for training on ``device``.

    Raises:
        NotImplementedError: ``delayed`` (it needs Transformer Engine on a CUDA GPU).
        ValueError: an unknown name.
    """
    if isinstance(recipe, Float8Recipe):
        return recipe
    if recipe in RECIPES:
        return RECIPES[recipe]
    if recipe in NEEDS_TE:
        where = torch.device(device).type
        raise NotImplementedError(
            f"FP8 recipe={recipe!r} on device {where!r}: {NEEDS_TE[recipe]} needs Transformer Engine's FP8 on a CUDA "
            f"GPU, which this package does not wire yet; the recipes that run here, on CPU and CUDA, are "
            f"{list(RECIPES)}. Use recipe='rowwise' (the closest in accuracy), recipe='mxfp8' or recipe='tensorwise'."
        )
    raise ValueError(
        f"FP8 recipe={recipe!r} is not a known recipe; the recipes are {list(RECIPES)} (and {list(NEEDS_TE)}, which "
        "need Transformer Engine). Pass one of those names or a `Float8Recipe`."
    )
