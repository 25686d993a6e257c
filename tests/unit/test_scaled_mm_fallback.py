"""``_compat.torch.scaled_mm`` on a CPU torch whose ``torch._scaled_mm`` takes only per-tensor scales (torch 2.11:
"Now _scaled_mm only supports per-tensor scaling for CPU backend"): rowwise scales go to ``_scaled_mm_reference``,
the float32 product of the FP8 values times the scales. This torch (2.13) takes rowwise scales on CPU, so the
fallback is forced here (the probe patched, or ``torch._scaled_mm`` replaced by one that refuses as 2.11's does)
and compared with the native kernel:

- bitwise where every step is exact (small integers, power-of-two scales: each product, sum and scaling is exact in
  float32 and the result representable in the output dtype), and on random FP8 values with power-of-two scales
  (the rowwise recipe's), where both sum the same exact float32 products;
- otherwise within the float32 reordering bound of ``K`` sums and the two scale products
  (``reordered_sum_tol(K + 2)``, ``tests/helpers/tolerance.py``) of the terms' absolute values, plus one rounding
  of each side to the output dtype.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch.torch_version import TorchVersion

from lightning_moe_overlap._compat import torch as torch_compat
from lightning_moe_overlap.fp8 import RECIPES, fp8_matmul
from tests.helpers.tolerance import reordered_sum_tol, unit_roundoff

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_PAIRS = [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)]
OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
native_scaled_mm = torch._scaled_mm


def _refusing_scaled_mm(mat_a: Tensor, mat_b: Tensor, *, scale_a: Tensor, scale_b: Tensor, **kwargs) -> Tensor:
    """torch 2.11's CPU kernel: per-tensor scales only."""
    if mat_a.device.type == "cpu" and (scale_a.numel() != 1 or scale_b.numel() != 1):
        raise RuntimeError("(scale_a.numel() == 1 && scale_b.numel() == 1) INTERNAL ASSERT FAILED")
    return native_scaled_mm(mat_a, mat_b, scale_a=scale_a, scale_b=scale_b, **kwargs)


@pytest.fixture
def torch_2_11_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch._scaled_mm`` as torch 2.11's CPU kernel, and the probe's cache empty before and after."""
    torch_compat._cpu_scaled_mm_takes_scale_vectors.cache_clear()
    monkeypatch.setattr(torch, "_scaled_mm", _refusing_scaled_mm)
    yield
    torch_compat._cpu_scaled_mm_takes_scale_vectors.cache_clear()


def _operands(m: int, k: int, n: int, dtypes: tuple, seed: int, integers: bool) -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    if integers:
        a, b = torch.randint(-3, 4, (m, k), generator=g).float(), torch.randint(-3, 4, (n, k), generator=g).float()
    else:
        a, b = torch.randn(m, k, generator=g) * 8, torch.randn(n, k, generator=g) * 8
    scale_a = torch.exp2(torch.randint(-4, 3, (m, 1), generator=g).float())
    scale_b = torch.exp2(torch.randint(-4, 3, (1, n), generator=g).float())
    return a.to(dtypes[0]), b.to(dtypes[1]).t(), scale_a, scale_b  # b column-major


def _bound(qa: Tensor, qb_KN: Tensor, scale_a: Tensor, scale_b: Tensor, ref: Tensor, out_dtype: torch.dtype) -> Tensor:
    """Two evaluations in float32 of the ``K`` sums and two scale products, each rounded once to ``out_dtype``
    (``ref``: either one, or the exact value)."""
    terms = (qa.double().abs() @ qb_KN.double().abs()) * scale_a.double() * scale_b.double()
    apart = reordered_sum_tol(qa.shape[1] + 2, terms)
    return apart + unit_roundoff(out_dtype) * (2 * ref.float().abs() + apart)


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("dtypes", FP8_PAIRS, ids=lambda d: f"{str(d[0])[11:]}x{str(d[1])[11:]}")
@pytest.mark.parametrize("integers", [True, False], ids=["integers", "random"])
def test_reference_is_bitwise_the_native_kernel_with_power_of_two_scales(
    dtypes: tuple, out_dtype: torch.dtype, integers: bool
) -> None:
    if not torch_compat._cpu_scaled_mm_takes_scale_vectors(*dtypes, out_dtype):
        pytest.skip(f"Requires: a CPU torch._scaled_mm that takes rowwise scales (torch {torch.__version__} does not)")
    for seed in range(3):
        qa, qb, scale_a, scale_b = _operands(32, 48, 16, dtypes, seed, integers)
        native = native_scaled_mm(qa, qb, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
        reference = torch_compat._scaled_mm_reference(qa, qb, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
        assert reference.dtype == out_dtype and torch.isfinite(native).all()
        assert torch.equal(native, reference), (seed, (native.float() - reference.float()).abs().max())


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_is_the_native_kernel_within_float32_reordering_with_any_scales(out_dtype: torch.dtype) -> None:
    if not torch_compat._cpu_scaled_mm_takes_scale_vectors(E4M3, E4M3, out_dtype):
        pytest.skip(f"Requires: a CPU torch._scaled_mm that takes rowwise scales (torch {torch.__version__} does not)")
    g = torch.Generator().manual_seed(0)
    qa, qb = (torch.randn(37, 64, generator=g) * 40).to(E4M3), (torch.randn(48, 64, generator=g) * 40).to(E4M3).t()
    scale_a, scale_b = torch.rand(37, 1, generator=g) + 0.1, torch.rand(1, 48, generator=g) + 0.1
    native = native_scaled_mm(qa, qb, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    reference = torch_compat._scaled_mm_reference(qa, qb, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    diff = (native.float() - reference.float()).abs()
    assert (diff <= _bound(qa, qb, scale_a, scale_b, reference, out_dtype)).all()


def test_this_torch_2_13_takes_rowwise_scales_on_cpu() -> None:
    if TorchVersion(torch.__version__) < (2, 13):
        pytest.skip(f"Requires: torch >= 2.13 (its CPU kernel takes rowwise scales; this is {torch.__version__})")
    assert all(torch_compat._cpu_scaled_mm_takes_scale_vectors(a, b, out) for a, b in FP8_PAIRS for out in OUT_DTYPES)


def test_the_probe_says_no_for_a_kernel_that_refuses_or_ignores_scale_vectors(
    torch_2_11_cpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not torch_compat._cpu_scaled_mm_takes_scale_vectors(E4M3, E4M3, torch.float32)
    torch_compat._cpu_scaled_mm_takes_scale_vectors.cache_clear()

    def first_scale_only(mat_a: Tensor, mat_b: Tensor, *, scale_a: Tensor, scale_b: Tensor, **kwargs) -> Tensor:
        return native_scaled_mm(mat_a, mat_b, scale_a=scale_a.reshape(-1)[0], scale_b=scale_b.reshape(-1)[0], **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", first_scale_only)
    assert not torch_compat._cpu_scaled_mm_takes_scale_vectors(E4M3, E4M3, torch.float32)


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("dtypes", FP8_PAIRS, ids=lambda d: f"{str(d[0])[11:]}x{str(d[1])[11:]}")
def test_scaled_mm_on_a_torch_2_11_cpu_gives_the_native_rowwise_result(
    torch_2_11_cpu: None, dtypes: tuple, out_dtype: torch.dtype
) -> None:
    qa, qb, scale_a, scale_b = _operands(32, 48, 16, dtypes, seed=1, integers=False)
    with pytest.raises(RuntimeError, match="INTERNAL ASSERT"):  # the kernel as 2.11 has it
        torch._scaled_mm(qa, qb, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    got = torch_compat.scaled_mm(qa, qb, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    assert got.dtype == out_dtype
    exact = (qa.double() @ qb.double()) * scale_a.double() * scale_b.double()
    assert ((got.double() - exact).abs() <= _bound(qa, qb, scale_a, scale_b, exact, out_dtype)).all()
    try:  # this torch's own kernel, where it takes rowwise scales on CPU (2.13's): bitwise the same
        native = native_scaled_mm(qa, qb, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    except RuntimeError:  # a real torch 2.11: the float64 bound above is the check
        native = got
    assert torch.equal(got, native)  # power-of-two scales: the same exact products summed alike
    one = torch.tensor(1.0)  # per-tensor scales still go to the kernel
    tensorwise = torch_compat.scaled_mm(qa, qb, scale_a=one, scale_b=one, out_dtype=out_dtype)
    assert torch.equal(tensorwise, native_scaled_mm(qa, qb, scale_a=one, scale_b=one, out_dtype=out_dtype))


@pytest.mark.parametrize("roles", [("input", "weight"), ("grad", "input")], ids="-".join)
def test_the_rowwise_fp8_gemm_runs_on_a_torch_2_11_cpu(torch_2_11_cpu: None, roles: tuple) -> None:
    """The product's rowwise FP8 GEMM (the experts' kernel) runs there, and gives 2.13's native result."""
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(40, 72, generator=g), torch.randn(24, 72, generator=g)  # K = 72: padded to 80
    got = fp8_matmul(a, b, RECIPES["rowwise"], roles, torch.bfloat16)
    torch_compat._cpu_scaled_mm_takes_scale_vectors.cache_clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "_scaled_mm", native_scaled_mm)
        if not torch_compat._cpu_scaled_mm_takes_scale_vectors(E4M3, E4M3, torch.bfloat16):
            pytest.skip(f"Requires: a CPU torch._scaled_mm that takes rowwise scales (torch {torch.__version__})")
        native = fp8_matmul(a, b, RECIPES["rowwise"], roles, torch.bfloat16)
    assert torch.equal(got, native)
