"""FP8 training: recipes, the FP8 GEMM, dense linears (torchao) and the experts' FP8 kernel (docs/fp8.md).

The entry point is :func:`apply_fp8`; the rest is what it is built from.
"""

from lightning_moe_overlap.fp8.apply import Float8Report, apply_fp8, has_fp8_kernel
from lightning_moe_overlap.fp8.dense import default_linear_filter
from lightning_moe_overlap.fp8.experts_kernel import Float8ExpertsKernel, Float8GroupedLinear
from lightning_moe_overlap.float8.gemm import fp8_matmul
from lightning_moe_overlap.float8.recipes import RECIPES, Float8Recipe, resolve_recipe
from lightning_moe_overlap.float8.rows import Float8Rows

__all__ = [
    "RECIPES",
    "Float8ExpertsKernel",
    "Float8GroupedLinear",
    "Float8Recipe",
    "Float8Report",
    "Float8Rows",
    "apply_fp8",
    "default_linear_filter",
    "fp8_matmul",
    "has_fp8_kernel",
    "resolve_recipe",
]
