"""The ``mxfp8`` recipe (OCP microscaling: e4m3 values, one e8m0 scale per block of 32 along the contraction dim).

Oracles: a plain loop over 32-blocks computing each block's e8m0 exponent by torchao's ``RCEIL`` rule with Python
floats; torchao's own ``to_mx`` and ``MXFP8Linear`` (emulated kernels, CPU); float64 GEMMs (SQNR, the rowwise
bound of ``test_fp8_gemm.py``: >= 27 dB); the rules' ids and fixes. Measured with torch 2.13 and torchao 0.18 on CPU:
one GEMM (Gaussian, e4m3 x e4m3 for every role pair) 27.7-29.0 dB.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

from lightning_moe_overlap.config import OverlapConfig
from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.fp8 import RECIPES, Float8ExpertsKernel, apply_fp8, fp8_matmul
from lightning_moe_overlap.fp8.experts_kernel import Float8GroupedLinear
from lightning_moe_overlap.float8.gemm import fp8_matmul_rows
from lightning_moe_overlap.float8.rows import Float8Rows, quantize_rows
from lightning_moe_overlap.float8.scaling import dequantize, quantize, quantize_blocks
from lightning_moe_overlap.moe import Experts
from lightning_moe_overlap.moe.grouped import RowSplits
from lightning_moe_overlap.parallel.tp_styles import PLANNED_ATTR
from lightning_moe_overlap.validation import check_fp8, check_fp8_model
from tests.unit.test_fp8_dispatch import _run as run_dispatch
from tests.unit.test_fp8_gemm import FORWARD_DB, sqnr_db

MX = RECIPES["mxfp8"]
E4M3_MAX = 448.0
ROLES = [("input", "weight"), ("grad", "weight"), ("grad", "input")]


def _oracle_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 32-block of each row: exponent ``max(ceil(log2(amax / 448)), -127)`` (Python floats), the values
    divided by ``2 ** exponent``, saturated and cast to e4m3 one block at a time."""
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn)
    scales = torch.empty(rows, k // 32)
    for r in range(rows):
        for b in range(k // 32):
            block = [float(v) for v in x[r, 32 * b : 32 * (b + 1)]]
            amax = max(abs(v) for v in block)
            exponent = -127 if amax == 0 else max(math.ceil(math.log2(amax / E4M3_MAX)), -127)
            scales[r, b] = 2.0**exponent
            scaled = [max(-E4M3_MAX, min(E4M3_MAX, v / 2.0**exponent)) for v in block]
            q[r, 32 * b : 32 * (b + 1)] = torch.tensor(scaled, dtype=torch.float64).to(torch.float8_e4m3fn)
    return q, scales


def _ranged(rows: int, k: int, seed: int) -> torch.Tensor:
    """Gaussian rows spanning 10^-4 .. 10^4, a zero block and an exact power-of-two amax among them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-4, 4, rows).unsqueeze(1)
    x[1, :32] = 0.0
    x[2, 32:64] = x[2, 32:64].clamp(-1000.0, 1000.0)
    x[2, 40] = 1024.0  # amax a power of two: 1024 / 448 -> exponent 2
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_quantiser_matches_the_per_block_loop_oracle(dtype: torch.dtype) -> None:
    x = _ranged(6, 96, seed=0).to(dtype)
    q, scale = quantize(x, MX, "input")
    q_ref, scale_ref = _oracle_blocks(x.float())
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6, 3)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(q[1, :32].float(), torch.zeros(32))  # the zero block quantises to zeros


def test_block_quantiser_is_torchaos_to_mx_bit_for_bit() -> None:
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    config = pytest.importorskip("torchao.prototype.mx_formats.config")
    x = _ranged(8, 128, seed=1)
    scale_e8m0, data = mx_tensor.to_mx(x, torch.float8_e4m3fn, 32, config.ScaleCalculationMode.RCEIL)
    q, scale = quantize_blocks(x, 32, torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(scale, scale_e8m0.float())  # e8m0 holds exactly these powers of two


def test_block_quantiser_refuses_a_partial_block() -> None:
    with pytest.raises(ValueError, match=r"K=48 is not a multiple of block_size=32.*Pad K to a multiple of 32"):
        quantize_blocks(torch.randn(2, 48), 32, torch.float8_e4m3fn)


@pytest.mark.parametrize("roles", ROLES, ids="-".join)
@pytest.mark.parametrize("shape", [(256, 128, 64), (37, 64, 48), (16, 13, 32)], ids=lambda s: "x".join(map(str, s)))
def test_mx_gemm_meets_the_rowwise_bound_against_float64(shape: tuple[int, int, int], roles: tuple) -> None:
    m, k, n = shape
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        a, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
        out = fp8_matmul(a, b, MX, roles, torch.float32)
        assert sqnr_db(a.double() @ b.double().t(), out) >= FORWARD_DB, (seed, roles)


def test_mx_scales_follow_blocks_where_rowwise_loses_the_ordinary_ones() -> None:
    """In every row the first block of 32 is 10^4 larger: a row scale pushes the row's other blocks towards e4m3's
    subnormals, block scales do not (the ordinary blocks' product, their operand quantised: measured mxfp8
    31.5-31.9 dB, rowwise 26.9-27.8 dB)."""
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        a, b = torch.randn(64, 128, generator=g), torch.randn(48, 128, generator=g)
        a[:, :32] *= 1e4
        ref = a[:, 32:].double() @ b[:, 32:].double().t()
        mx, row = (
            sqnr_db(ref, dequantize(*quantize(a, RECIPES[name], "input"))[:, 32:] @ b[:, 32:].t())
            for name in ("mxfp8", "rowwise")
        )
        assert mx >= 30.0 and mx >= row + 3.0, (seed, mx, row)


def test_dense_mx_linear_is_torchaos_mx_linear_for_any_rows() -> None:
    """18 token rows (not a multiple of 32): forward, input and weight gradients equal torchao's MX linear run on
    the rows padded with zero rows by hand; under bf16 autocast it writes bf16 with float32 weight gradients."""
    mxfp8_linear = pytest.importorskip("torchao.prototype.moe_training.mxfp8_linear")
    kernels = pytest.importorskip("torchao.quantization.quantize_.common.kernel_preference")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96))
    reference = mxfp8_linear.MXFP8Linear(64, 96, kernel_preference=kernels.KernelPreference.EMULATED)
    reference.load_state_dict(model[0].state_dict())
    report = apply_fp8(model, "mxfp8", experts=False)
    assert report.linears == ("0",) and type(model[0]).__name__ == "MXLinear"
    x = torch.randn(2, 9, 64, requires_grad=True)
    x_ref = torch.cat([x.detach().reshape(18, 64), torch.zeros(14, 64)]).requires_grad_()
    g = torch.randn(2, 9, 96)
    out = model(x)
    out.backward(g)
    out_ref = reference(x_ref)
    out_ref.backward(torch.cat([g.reshape(18, 96), torch.zeros(14, 96)]))
    assert torch.equal(out.reshape(18, 96), out_ref[:18].detach())
    assert torch.equal(x.grad.reshape(18, 64), x_ref.grad[:18])
    assert torch.equal(model[0].weight.grad, reference.weight.grad)
    assert torch.equal(model[0].bias.grad, reference.bias.grad)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and model[0].weight.grad.dtype == torch.float32


def test_experts_gemm_is_the_dense_mx_gemm() -> None:
    """The experts' kernel and torchao's MX linear quantise and multiply alike (bitwise, 64 rows)."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=False)
    model = nn.Sequential(linear)
    apply_fp8(model, "mxfp8", experts=False)
    x = torch.randn(64, 64)
    assert torch.equal(model(x).detach(), fp8_matmul(x, linear.weight.detach(), MX, ("input", "weight"),
                                                     torch.float32))  # fmt: skip


def test_dims_not_multiple_of_32_stay_in_high_precision_with_the_reason() -> None:
    model = nn.ModuleDict({"odd": nn.Linear(48, 64), "ok": nn.Linear(64, 96)})
    report = apply_fp8(model, "mxfp8")
    assert report.linears == ("ok",)
    assert report.skipped["odd"] == "in_features=48, out_features=64: FP8 GEMMs need both to be multiples of 32"
    experts = nn.ModuleDict({"experts": Experts(4, 48, 64)})
    report = apply_fp8(experts, "mxfp8")
    assert report.experts == () and report.skipped["experts"] == "expert weight dims [48, 64, 128]: FP8 GEMMs need " \
        "multiples of 32"  # fmt: skip
    assert apply_fp8(nn.ModuleDict({"experts": Experts(4, 48, 64)}), "rowwise").experts == ("experts",)


def test_mx_experts_dispatch_in_high_precision_and_read_fp8_rows_dequantised() -> None:
    assert Float8ExpertsKernel(MX).dispatch_recipe is None
    out, dx, dw, sent, rows, _ = run_dispatch("mxfp8", True)
    ref_out, ref_dx, ref_dw, *_ = run_dispatch("mxfp8", False)
    assert torch.equal(out, ref_out) and torch.equal(dx, ref_dx) and torch.equal(dw, ref_dw)
    assert sent[1] == rows * 32 * 4  # the tokens' exchange: float32 rows (hidden 32), no FP8 bytes
    # rows that arrive in FP8 all the same are dequantised first
    x = torch.randn(10, 32)
    q, scale = quantize_rows(x, RECIPES["rowwise"])
    rows_fp8 = Float8Rows(q, scale, torch.float32)
    weight = torch.randn(2, 64, 32)
    splits = RowSplits([4, 6])
    got = Float8GroupedLinear.apply(rows_fp8, weight, splits, False, MX, None, ())
    want = Float8GroupedLinear.apply(rows_fp8.dequantized(), weight, splits, False, MX, None, ())
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"recipe 'mxfp8' scales blocks of 32 values, not rows.*call `fp8_matmul`"):
        fp8_matmul_rows(q, scale, weight[0], MX, "weight", torch.float32)


def test_mx_linear_refuses_a_tensor_parallel_linear_and_a_foreign_recipe() -> None:
    from lightning_moe_overlap.fp8.mx_linear import MXLinear

    planned = nn.Linear(64, 64)
    setattr(planned, PLANNED_ATTR, object())
    model = nn.ModuleDict({"a": nn.Linear(64, 64), "p": planned})
    with pytest.raises(NotImplementedError, match=r"\['p'\] are tensor-parallel.*Use recipe='rowwise' or 'tensorwise'"):
        apply_fp8(model, "mxfp8")
    assert type(model["a"]) is nn.Linear  # nothing swapped
    with pytest.raises(ValueError, match=r"is not torchao's MXFP8 recipe.*Pass recipe 'mxfp8'"):
        MXLinear.from_linear(nn.Linear(64, 64), RECIPES["rowwise"])


def _rules(problems) -> list[tuple[str, str]]:
    return [(p.rule, p.error.__name__ if p.error else "warning") for p in problems]


def test_mxfp8_rules() -> None:
    problems = check_fp8("mxfp8", OverlapConfig(ep=2))
    assert _rules(problems) == [("fp8-dispatch-high-precision", "warning")]
    assert re.search(r"MXFP8 but the rows are dispatched in high precision.*Use fp8='rowwise'", problems[0].message)
    assert _rules(check_fp8("mxfp8", OverlapConfig(dispatcher="allgather"))) == _rules(problems)  # one warning
    problems = check_fp8("mxfp8", OverlapConfig(tp=2, ep=2))
    assert _rules(problems) == [("fp8-mxfp8-tp", "NotImplementedError"), ("fp8-dispatch-high-precision", "warning")]
    assert "tp=2" in problems[0].message and "Use tp=1 with fp8='mxfp8'" in problems[0].message
    # dims: multiples of 32 (hidden 48 runs rowwise but not mxfp8)
    model = MoEGPT(vocab_size=64, hidden_size=48, num_layers=1, num_heads=4, num_experts=4, ffn_hidden_size=32)
    assert check_fp8_model("rowwise", model) == []
    problems = check_fp8_model("mxfp8", model)
    assert _rules(problems) == [("fp8-dims", "warning")] and "Pad those dims to multiples of 32" in problems[0].message
