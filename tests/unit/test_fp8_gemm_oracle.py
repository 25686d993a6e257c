"""Each FP8 GEMM the experts run, on each device, against the float64 product of the dequantised FP8 operands that
device produced: the oracle the CUDA test (``tests/gpu/test_fp8_cuda.py``) uses, run here on CPU, with planted
faults it must catch.

Why this oracle and not the other device: CPU and CUDA quantise the same float32 values, but an upstream GEMM's
accumulation order differs a little between them, and a value near an FP8 rounding boundary then lands one FP8
step apart (a relative 2**-3 for e4m3, 2**-2 for e5m2, far above float32's), so no bound between the two devices'
results follows from the arithmetic. Each GEMM against its own operands does: only its accumulation and the
output's rounding are left (``scaled_gemm_tol``, ``tests/helpers/tolerance.py``).

:func:`record_fp8_gemms` wraps the experts' ``fp8_matmul`` and the ``quantize`` it calls, so every GEMM is kept
with the FP8 operands and scales it actually multiplied; :func:`assert_fp8_gemms_match_float64` dequantises them in
float64 (its own code, not the package's ``dequantize``) and checks each output.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from torch import Tensor

from lightning_moe_overlap.fp8 import RECIPES, Float8ExpertsKernel, Float8GroupedLinear, fp8_matmul
from lightning_moe_overlap.moe import Experts
from tests.helpers.tolerance import assert_within, scaled_gemm_tol, unit_roundoff

E, D, F, T, K = 4, 64, 32, 96, 2
FLOAT32_ACCUMULATION_U = unit_roundoff(torch.float32)


@dataclass
class Fp8Gemm:
    """One FP8 GEMM as it ran: ``out = dequant(qa, scale_a) @ dequant(qb, scale_b).T``, ``qa [M, K]``, ``qb [N, K]``
    (scales 0-d, one per row ``[M, 1]``, or one per block ``[M, K / block]``)."""

    recipe: str
    roles: tuple[str, str]
    qa: Tensor
    scale_a: Tensor
    qb: Tensor
    scale_b: Tensor
    out: Tensor


@contextmanager
def record_fp8_gemms() -> Iterator[list[Fp8Gemm]]:
    """Every ``fp8_matmul`` the FP8 experts call inside the block, with the operands its ``quantize`` produced."""
    gemm_module = sys.modules[fp8_matmul.__module__]
    kernel_module = sys.modules[Float8GroupedLinear.__module__]
    real_quantize, real_matmul = gemm_module.quantize, kernel_module.fp8_matmul
    records: list[Fp8Gemm] = []
    operands: list[tuple[Tensor, Tensor]] = []

    def quantize(x: Tensor, recipe, role):  # type: ignore[no-untyped-def]
        q, scale = real_quantize(x, recipe, role)
        operands.append((q, scale))
        return q, scale

    def matmul(a: Tensor, b: Tensor, recipe, roles, out_dtype):  # type: ignore[no-untyped-def]
        operands.clear()
        out = real_matmul(a, b, recipe, roles, out_dtype)
        (qa, scale_a), (qb, scale_b) = operands
        records.append(Fp8Gemm(recipe.name, tuple(roles), qa, scale_a, qb, scale_b, out))
        return out

    with mock.patch.object(gemm_module, "quantize", quantize), mock.patch.object(kernel_module, "fp8_matmul", matmul):
        yield records


def _dequantize64(q: Tensor, scale: Tensor) -> Tensor:
    """``q * scale`` in float64; block scales ``[M, B]`` cover ``K / B`` consecutive values each."""
    scale = scale.double()
    if scale.dim() and scale.shape[-1] not in (1, q.shape[-1]):
        scale = scale.repeat_interleave(q.shape[-1] // scale.shape[-1], dim=-1)
    return q.double() * scale


def assert_fp8_gemms_match_float64(gemms: list[Fp8Gemm], accumulation_u: float, where: str) -> None:
    """Each GEMM's output within ``scaled_gemm_tol`` of the float64 product of its dequantised operands."""
    assert gemms, f"{where}: no FP8 GEMM ran"
    for i, gemm in enumerate(gemms):
        a, b = _dequantize64(gemm.qa.cpu(), gemm.scale_a.cpu()), _dequantize64(gemm.qb.cpu(), gemm.scale_b.cpu())
        ref = a @ b.T
        bound = scaled_gemm_tol(a.shape[1], a.abs() @ b.abs().T, ref, gemm.out.dtype, accumulation_u)
        assert_within(gemm.out.cpu(), ref, bound, f"{where}: GEMM {i} ({gemm.recipe}, {'-'.join(gemm.roles)})")


def run_fp8_experts(experts: Experts, seed: int, dtype: torch.dtype, device: str) -> list[Tensor]:
    """A forward and backward of ``experts`` (moved to ``device``) on seeded tokens, expert ``E - 1`` given none:
    the output and the three gradients, on the CPU."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, E - 1, (T, K), generator=g)
    x, w, g_out = torch.randn(T, D, generator=g), torch.rand(T, K, generator=g), torch.randn(T, D, generator=g)
    x = x.to(device, dtype).requires_grad_()
    out = experts(x, idx.to(device), w.to(device, dtype))
    out.backward(g_out.to(device, dtype))
    return [t.detach().float().cpu() for t in (out, x.grad, experts.gate_up_proj.grad, experts.down_proj.grad)]


def fp8_experts(recipe: str, dtype: torch.dtype) -> Experts:
    torch.manual_seed(0)
    experts = Experts(E, D, F, init_std=0.1, dtype=dtype)
    experts.kernel = Float8ExpertsKernel(RECIPES[recipe])
    return experts


# forward, dgrad and wgrad of both projections, for each of the E - 1 experts with rows
GEMMS_PER_STEP = 3 * 2 * (E - 1)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_cpu_fp8_gemm_matches_float64_of_its_own_operands(recipe: str, dtype: torch.dtype) -> None:
    experts = fp8_experts(recipe, dtype)
    with record_fp8_gemms() as gemms:
        results = run_fp8_experts(experts, 1, dtype, "cpu")
    assert len(gemms) == GEMMS_PER_STEP and all(torch.isfinite(r).all() for r in results)
    assert_fp8_gemms_match_float64(gemms, FLOAT32_ACCUMULATION_U, f"cpu {recipe} {dtype}")


def _column_major(x: Tensor) -> Tensor:
    return x.t().contiguous().t()


FAULTS = ["missing scale_b", "operand transposed", "one FP8 step in every operand"]


@pytest.mark.parametrize(
    ("recipe", "fault"),
    [("tensorwise", f) for f in FAULTS] + [("rowwise", f) for f in [*FAULTS, "scale_b ignored past the first"]],
)
def test_the_oracle_catches_a_wrong_kernel(recipe: str, fault: str) -> None:
    """Planted in the kernel the product calls (``_compat.torch.scaled_mm``), each of these fails the check."""
    from lightning_moe_overlap._compat import torch as torch_compat

    real = torch_compat.scaled_mm

    def faulty(a: Tensor, b: Tensor, *, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype) -> Tensor:
        if fault == "missing scale_b":
            scale_b = torch.ones_like(scale_b)
        elif fault == "scale_b ignored past the first":
            scale_b = scale_b.reshape(-1)[:1].expand(scale_b.shape).contiguous()
        elif fault == "operand transposed":  # b [K, N] read as [N, K] (square); else read backwards along K
            b = _column_major(b.t() if b.shape[0] == b.shape[1] else b.view(torch.uint8).flip(0).view(b.dtype))
        else:  # the next FP8 magnitude for every finite nonzero entry of a: what a wrong rounding would give
            bits = a.view(torch.uint8)
            magnitude = bits & 0x7F
            a = torch.where((magnitude != 0) & (magnitude < 0x7B), bits + 1, bits).view(a.dtype)
        return real(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)

    experts = fp8_experts(recipe, torch.float32)
    with mock.patch.object(torch_compat, "scaled_mm", faulty), record_fp8_gemms() as gemms:
        run_fp8_experts(experts, 1, torch.float32, "cpu")
    with pytest.raises(AssertionError, match="apart by more than the derived bound"):
        assert_fp8_gemms_match_float64(gemms, FLOAT32_ACCUMULATION_U, f"cpu {recipe} {fault}")


def test_the_cuda_accumulation_bound_still_catches_a_wrong_kernel() -> None:
    """The CUDA bound (14-bit accumulation) is looser than float32's, but a missing scale still fails it."""
    from lightning_moe_overlap._compat import torch as torch_compat
    from tests.helpers.tolerance import CUDA_FP8_ACCUMULATION_U

    real = torch_compat.scaled_mm
    experts = fp8_experts("rowwise", torch.float32)

    def unscaled(a: Tensor, b: Tensor, *, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype) -> Tensor:
        return real(a, b, scale_a=scale_a, scale_b=torch.ones_like(scale_b), out_dtype=out_dtype)

    with record_fp8_gemms() as good:
        run_fp8_experts(experts, 1, torch.float32, "cpu")
    assert_fp8_gemms_match_float64(good, CUDA_FP8_ACCUMULATION_U, "cpu rowwise, CUDA bound")
    with mock.patch.object(torch_compat, "scaled_mm", unscaled), record_fp8_gemms() as bad:
        run_fp8_experts(fp8_experts("rowwise", torch.float32), 1, torch.float32, "cpu")
    with pytest.raises(AssertionError, match="apart by more than the derived bound"):
        assert_fp8_gemms_match_float64(bad, CUDA_FP8_ACCUMULATION_U, "cpu rowwise, CUDA bound")
