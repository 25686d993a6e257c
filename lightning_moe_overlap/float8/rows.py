"""Token rows already in FP8: e4m3 values with one scale per row, as the FP8 dispatch delivers them.

With FP8 dispatch (``docs/fp8.md``) the all-to-all dispatcher quantises each token row before the exchange (one
scale per row, over the hidden dim: what a rowwise scale of the experts' first GEMM covers), sends the e4m3 bytes
and the scales in one exchange, and hands the experts a :class:`Float8Rows`: a tensor of the rows' shape and
high-precision dtype that holds only the FP8 values and the scales. The experts' FP8 kernel
(``fp8/experts_kernel.py``) reads them as they are, without a round trip to high precision; the gradient that flows
back into it is an ordinary high-precision tensor (the backward of the dispatch stays in high precision).

Any other operation on a :class:`Float8Rows` sees what the rows stand for, ``q * scale`` in its dtype (a
correct, slower fallback), so code that does not know the type still computes the right thing.

Wire format, :func:`pack_rows`: ``[N, D + 4]`` bytes per exchange, each row its ``D`` e4m3 bytes then its float32
scale's four bytes, so one ``all_to_all_single`` carries both (the scales travel with their rows).

Shape legend:
    N: rows   D: hidden size (the GEMM's contraction dim)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from lightning_moe_overlap._compat import torch as torch_compat
from lightning_moe_overlap.float8.recipes import Float8Recipe
from lightning_moe_overlap.float8.scaling import dequantize, quantize

SCALE_BYTES = 4  # a float32 scale per row


def row_recipe(recipe: Float8Recipe) -> Float8Recipe:
    """How the dispatch quantises rows for ``recipe``: one scale per row, in the recipe's forward format and with its
    power-of-two rule (for ``rowwise``, exactly what its first GEMM would do with the rows)."""
    return recipe if recipe.granularity == "row" else dataclasses.replace(recipe, granularity="row")


def quantize_rows(x_ND: Tensor, recipe: Float8Recipe) -> tuple[Tensor, Tensor]:
    """``(q_ND, scale_N1)``: each row of ``x_ND`` in e4m3 (the recipe's forward format) with its float32 scale."""
    return quantize(x_ND, row_recipe(recipe), "input")


def pack_rows(q_ND: Tensor, scale_N1: Tensor) -> Tensor:
    """``[N, D + 4]`` uint8: each row's FP8 bytes, then its scale's bytes (the wire format)."""
    return torch.cat([q_ND.view(torch.uint8), scale_N1.float().contiguous().view(torch.uint8)], dim=1)


def unpack_rows(packed: Tensor, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The inverse of :func:`pack_rows`: ``(q_ND, scale_N1)``, contiguous."""
    width = packed.shape[1] - SCALE_BYTES
    q_ND = packed[:, :width].contiguous().view(fp8_dtype)
    scale_N1 = packed[:, width:].contiguous().view(torch.float32)
    return q_ND, scale_N1


class Float8Rows(Tensor):
    """Rows ``[N, D]`` of high-precision ``dtype`` held as ``data`` (FP8, ``[N, D]``) and ``scale`` (``[N, 1]``).

    Built by the FP8 dispatch (``moe/dispatch/float8.py``); read as they are by the experts' FP8 kernel; any other
    operation gets the dequantised rows (see the module docstring).
    """

    data_fp8: Tensor
    scale: Tensor
    __torch_function__ = torch_compat.disabled_torch_function()  # every operation goes through __torch_dispatch__

    @staticmethod
    def __new__(cls, data_fp8: Tensor, scale: Tensor, dtype: torch.dtype) -> Float8Rows:
        return torch_compat.make_wrapper_subclass(cls, data_fp8.shape, dtype=dtype, device=data_fp8.device)

    def __init__(self, data_fp8: Tensor, scale: Tensor, dtype: torch.dtype) -> None:
        self.data_fp8, self.scale = data_fp8, scale

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Float8Rows(shape={tuple(self.shape)}, dtype={self.dtype}, data={self.data_fp8.dtype})"

    def __tensor_flatten__(self) -> tuple[list[str], torch.dtype]:
        return ["data_fp8", "scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, Tensor], dtype: torch.dtype, size: Any, stride: Any) -> Float8Rows:
        return Float8Rows(inner["data_fp8"], inner["scale"], dtype)

    def dequantized(self) -> Tensor:
        """``data * scale`` in the rows' dtype: what they stand for."""
        return dequantize(self.data_fp8, self.scale, self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            rows = args[0]
            return Float8Rows(rows.data_fp8, rows.scale, rows.dtype)

        def plain(t: Any) -> Any:
            return t.dequantized() if isinstance(t, Float8Rows) else t

        return func(*torch_compat.tree_map(plain, args), **torch_compat.tree_map(plain, kwargs or {}))

