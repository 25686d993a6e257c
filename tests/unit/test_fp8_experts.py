"""The experts in FP8 against the float32 experts, rows in segments against sorted rows, and delayed weight gradients
bitwise equal to inline ones (with the count of deferred GEMMs).

Bound (SQNR in dB per tensor, the whole expert MLP: two FP8 GEMMs with the activation between them): output, input
gradient and both weight gradients >= 18 dB against the float32 experts on the same weights and tokens (the loop
reference, ``impl="loop"``). Measured on these inputs with torch 2.13 CPU: outputs 23.4-26.6 dB; gradients 20.2-25.0
dB (tensorwise, e5m2 gradients) and 23.5-26.4 dB (rowwise).
"""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_moe_overlap.fp8 import RECIPES, Float8ExpertsKernel, apply_fp8
from lightning_moe_overlap.fp8.experts_kernel import Float8GroupedLinear
from lightning_moe_overlap.moe import ExpertParallelExperts, Experts, layout_of
from lightning_moe_overlap.moe.dispatch import AllToAllDispatcher
from lightning_moe_overlap.moe.grouped import RowSplits
from lightning_moe_overlap.overlap.runtime import CommRuntime
from tests.unit.test_fp8_gemm import sqnr_db

E, D, F, T, K = 4, 64, 32, 48, 2
MLP_DB = 18.0


def _experts(seed: int = 0, **kw) -> Experts:
    torch.manual_seed(seed)
    return Experts(E, D, F, init_std=0.1, **kw)


def _tokens(seed: int, one_expert: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    idx = torch.randint(0, E - 1, (T, K), generator=g)  # expert E-1 gets no tokens
    if one_expert:
        idx = torch.stack([torch.zeros(T, dtype=torch.long), torch.full((T,), E - 1)], dim=1)  # 0 and E-1 only
    return x, idx, torch.rand(T, K, generator=g)


def _run(module: torch.nn.Module, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, g_out: torch.Tensor):
    x = x.clone().requires_grad_()
    out = module(x, idx, w)
    out.backward(g_out)
    return out.detach(), x.grad


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("one_expert", [False, True], ids=["spread", "two-experts"])
def test_fp8_experts_match_float32_experts_in_sqnr(recipe: str, one_expert: bool) -> None:
    for seed in range(3):
        reference = _experts(seed, impl="loop")
        fp8 = copy.deepcopy(reference)
        fp8.kernel = Float8ExpertsKernel(RECIPES[recipe])
        x, idx, w = _tokens(seed, one_expert)
        g_out = torch.randn(T, D, generator=torch.Generator().manual_seed(seed + 100))
        out_ref, dx_ref = _run(reference, x, idx, w, g_out)
        out, dx = _run(fp8, x, idx, w, g_out)
        assert sqnr_db(out_ref, out) >= MLP_DB and sqnr_db(dx_ref, dx) >= MLP_DB, (recipe, seed)
        for name in ("gate_up_proj", "down_proj"):
            ref_grad, grad = getattr(reference, name).grad, getattr(fp8, name).grad
            used = ref_grad.flatten(1).abs().sum(1) > 0
            assert torch.equal(grad[~used], torch.zeros_like(grad[~used]))  # experts with no tokens: zero
            assert sqnr_db(ref_grad[used], grad[used]) >= MLP_DB, (recipe, seed, name)
        assert fp8.gate_up_proj.dtype == torch.float32  # the masters stay float32


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("transposed", [False, True])
def test_rows_in_segments_give_the_sorted_rows_result(recipe: str, transposed: bool) -> None:
    """Expert 1's rows in two segments (the all-to-all's receive layout) against the same rows sorted by expert."""
    g = torch.Generator().manual_seed(3)
    x_sorted = torch.randn(10, D, generator=g)  # experts 0: 3 rows, 1: 5 rows, 2: 0, 3: 2
    w0 = torch.randn(*((E, D, 2 * F) if transposed else (E, 2 * F, D)), generator=g)
    g_sorted = torch.randn(10, 2 * F, generator=g)
    order = [0, 1, 2, 3, 4, 8, 9, 5, 6, 7]  # segments: e0 x3, e1 x2, e3 x2, e1 x3
    segments = RowSplits.from_segments([0, 1, 3, 1], [3, 2, 2, 3], E)
    results = []
    for x0, g0, splits in ((x_sorted, g_sorted, RowSplits([3, 5, 0, 2])), (x_sorted[order], g_sorted[order], segments)):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = Float8GroupedLinear.apply(x, w, splits, transposed, RECIPES[recipe], None, ())
        y.backward(g0)
        results.append((y.detach(), x.grad, w.grad))
    (y_s, dx_s, dw_s), (y_g, dx_g, dw_g) = results
    assert torch.equal(y_s[order], y_g) and torch.equal(dx_s[order], dx_g) and torch.equal(dw_s, dw_g)
    assert torch.equal(dw_s[2], torch.zeros_like(dw_s[2]))


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_delayed_wgrad_is_bitwise_the_inline_wgrad_and_defers_two_gemms_per_call(recipe: str) -> None:
    x, idx, w = _tokens(5)
    grads = []
    for delay in (False, True):
        runtime = CommRuntime(delay_wgrad=delay)
        experts = _experts(1, runtime=runtime)
        experts.kernel = Float8ExpertsKernel(RECIPES[recipe])
        deferred = []
        for micro_batch in range(2):  # the second accumulates into an existing .grad
            out = experts(x * (micro_batch + 1), idx, w)
            out.square().sum().backward()
            deferred.append(runtime.pending_wgrad)
            runtime.flush_wgrad()
        assert deferred == ([2, 2] if delay else [0, 0])  # gate_up and down: one deferred GEMM each per call
        grads.append((experts.gate_up_proj.grad, experts.down_proj.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_bf16_autocast_runs_the_fp8_experts_in_bf16_with_float32_gradients() -> None:
    experts = _experts(2)
    experts.kernel = Float8ExpertsKernel(RECIPES["tensorwise"])
    x, idx, w = _tokens(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = experts(x, idx, w)
    out.float().sum().backward()
    assert experts.gate_up_proj.grad.dtype == torch.float32 and torch.isfinite(experts.down_proj.grad).all()


def test_expert_parallel_experts_keep_the_fp8_kernel_of_their_source_and_run_it() -> None:
    source = _experts(4)
    apply_fp8(source, "rowwise", dense=False)
    reference = copy.deepcopy(source)
    reference.kernel = None
    wrapped = ExpertParallelExperts(source, layout_of(source), AllToAllDispatcher(None, E, CommRuntime()))
    assert wrapped.kernel == source.kernel
    x, idx, w = _tokens(4)
    g_out = torch.randn(T, D)
    out, dx = _run(wrapped, x, idx, w, g_out)
    out_fp8, dx_fp8 = _run(source, x, idx, w, g_out)
    torch.testing.assert_close(out, out_fp8)  # same FP8 numbers, through the dispatcher's layout
    torch.testing.assert_close(dx, dx_fp8)
    out_ref, _ = _run(reference, x, idx, w, g_out)
    assert not torch.equal(out, out_ref) and sqnr_db(out_ref, out) >= MLP_DB  # FP8, not the bf16/fp32 kernel
