"""Dense linears in MXFP8: torchao's ``MXFP8Linear`` with its emulated kernels, for any number of token rows.

torchao's MX linear (``torchao.prototype.moe_training.mxfp8_linear``) quantises every operand of its three GEMMs in
blocks of 32 along that GEMM's contraction dim, with e8m0 (power-of-two) scales and e4m3 values, and with
``KernelPreference.EMULATED`` computes each GEMM on the dequantised values in torch, so it trains on CPU and on any
GPU (the MX tensor cores of Blackwell GPUs are not used here). :class:`MXLinear` adds two things it leaves to the
caller:

- Any number of token rows: the weight gradient contracts over the rows, which torchao needs in whole blocks of 32;
  the rows are padded with zeros to the next multiple (zero rows add nothing to the products and do not move a
  block's amax) and the padded outputs are dropped.
- Autocast: under ``bf16-mixed`` the rows and the weight are cast to the autocast dtype first (as torchao's
  ``Float8Linear`` does), and the GEMMs run with autocast off; the weight's gradient is in its own dtype.

The weight and bias are the linear's own parameters (names, state-dict keys and optimizer state do not change).
This module imports torchao: :mod:`.dense` imports it on the first ``mxfp8`` conversion.

Shape legend:
    T: token rows (all leading dims)   P: rows padded to a multiple of 32   I, O: in and out features
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear, mx_mm
from torchao.prototype.mx_formats.config import (
    MXFP8Dim0CastKernelChoice,
    MXFP8Dim1CastKernelChoice,
    ScaleCalculationMode,
)
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

from lightning_moe_overlap.float8.recipes import MX_BLOCK, Float8Recipe
from lightning_moe_overlap.moe.grouped import autocast_dtype


class MXLinear(MXFP8Linear):
    """torchao's ``MXFP8Linear`` (emulated kernels, ``RCEIL`` scales) for any number of rows and under autocast."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Float8Recipe) -> MXLinear:
        """An :class:`MXLinear` holding ``linear``'s weight and bias, for ``recipe`` (``mxfp8``: e4m3 operands).

        Raises:
            ValueError: ``recipe`` is not torchao's MXFP8 recipe (blocks of 32, e4m3 everywhere).
        """
        if (recipe.granularity, recipe.block_size, recipe.forward_dtype, recipe.grad_dtype) != (
            "block", MX_BLOCK, torch.float8_e4m3fn, torch.float8_e4m3fn,
        ):  # fmt: skip
            raise ValueError(
                f"`MXLinear.from_linear`: recipe {recipe} is not torchao's MXFP8 recipe; its MX linear scales blocks "
                f"of {MX_BLOCK} values with e4m3 operands everywhere. Pass recipe 'mxfp8'."
            )
        with torch.device("meta"):
            mx = cls(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                kernel_preference=KernelPreference.EMULATED,
                scale_calculation_mode=ScaleCalculationMode.RCEIL,
            )
        mx.weight, mx.bias = linear.weight, linear.bias
        mx.train(linear.training)
        return mx

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002 - nn.Linear's argument name
        dtype = autocast_dtype(input)
        x = input if dtype is None else input.to(dtype)
        w = self.weight if dtype is None else self.weight.to(dtype)
        x_TI = x.reshape(-1, self.in_features)
        rows = x_TI.shape[0]
        pad = -rows % MX_BLOCK
        x_PI = F.pad(x_TI, (0, 0, 0, pad)) if pad else x_TI
        with torch.autocast(input.device.type, enabled=False):
            y_PO = mx_mm.apply(
                x_PI,
                w,
                torch.float8_e4m3fn,
                torch.float8_e4m3fn,
                torch.float8_e4m3fn,
                MX_BLOCK,
                self.kernel_preference,
                MXFP8Dim0CastKernelChoice.TORCH,
                MXFP8Dim1CastKernelChoice.TORCH,
                self.scale_calculation_mode,
                self.wgrad_with_hp,
            )
        y = y_PO[:rows].reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)
