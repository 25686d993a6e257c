"""The experts' GEMMs on CUDA: bf16 grouped GEMM against the per-expert loop with empty experts and odd group
sizes, bf16-mixed (fp32 weights under autocast) on both kernels with delayed wgrad, and no host sync on the
grouped path (``torch.cuda.set_sync_debug_mode("error")``)."""

from __future__ import annotations

import pytest
import torch

from lightning_moe_overlap.moe import grouped_linear, grouped_mlp
from lightning_moe_overlap.moe.grouped import grouped_mm_supported
from lightning_moe_overlap.overlap.runtime import CommRuntime

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="Requires: CUDA (grouped GEMM kernels, autocast)"),
]

SPLITS = [[0, 5, 0, 3, 7, 0], [13, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 9], [3, 11, 17, 5, 9, 2], [1, 0, 1, 0, 1, 0]]


def _needs_grouped_mm() -> None:
    probe = torch.zeros(2, 16, device="cuda", dtype=torch.bfloat16)
    if not grouped_mm_supported(probe, torch.zeros(1, 16, 16, device="cuda", dtype=torch.bfloat16)):
        pytest.skip("Requires: CUDA with torch._grouped_mm for bf16 (compute capability >= 8.0, torch >= 2.9)")


@pytest.mark.parametrize("splits", SPLITS, ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("transposed", [False, True])
def test_bf16_grouped_mm_matches_loop_with_empty_and_odd_groups(splits: list[int], transposed: bool) -> None:
    _needs_grouped_mm()
    g = torch.Generator(device="cuda").manual_seed(sum(splits))
    e, i, o = len(splits), 64, 96
    kw = {"device": "cuda", "generator": g}
    x0 = torch.randn(sum(splits), i, **kw).bfloat16()
    w0 = torch.randn(*((e, i, o) if transposed else (e, o, i)), **kw).bfloat16()
    upstream = torch.randn(sum(splits), o, **kw).bfloat16()
    results = []
    for impl in ("loop", "grouped_mm"):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = grouped_linear(x, w, torch.tensor(splits, device="cuda"), transposed=transposed, impl=impl)
        y.backward(upstream)
        results.append((y.detach().float(), x.grad.float(), w.grad.float()))
    for name, loop, grouped in zip(("forward", "dgrad", "wgrad"), *results):
        torch.testing.assert_close(grouped, loop, atol=0.1, rtol=2e-2, msg=lambda m, n=name: f"{n}: {m}")
    for expert, size in enumerate(splits):
        if size == 0:
            assert torch.count_nonzero(results[1][2][expert]) == 0


@pytest.mark.parametrize("impl", ["loop", "grouped_mm"])
@pytest.mark.parametrize("delay", [False, True])
def test_bf16_mixed_fp32_weights_backward(impl: str, delay: bool) -> None:
    """The CUDA crash of bf16-mixed: fp32 weights, forward under autocast, backward outside it."""
    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 9, 2], device="cuda")
    w1 = (torch.randn(4, 64, 32, device="cuda") * 0.2).requires_grad_()
    w2 = (torch.randn(4, 32, 32, device="cuda") * 0.2).requires_grad_()
    x = torch.randn(16, 32, device="cuda", requires_grad=True)
    runtime = CommRuntime(delay_wgrad=delay)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = grouped_mlp(x, counts, w1, w2, torch.nn.functional.silu, runtime, impl=impl)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    runtime.flush_wgrad()
    assert x.grad.dtype == w1.grad.dtype == w2.grad.dtype == torch.float32
    reference = []
    for t in (x, w1, w2):
        reference.append(t.detach().bfloat16().float().requires_grad_())
    xr, w1r, w2r = reference
    outs = []
    for x_e, a, b in zip(xr.split([5, 0, 9, 2]), w1r, w2r):
        gate, up = (x_e @ a.T).chunk(2, dim=-1)
        outs.append((torch.nn.functional.silu(gate) * up) @ b.T)
    torch.testing.assert_close(y.float(), torch.cat(outs), atol=5e-2, rtol=3e-2)


def test_grouped_path_has_no_host_sync() -> None:
    """Forward + backward of the grouped experts from device counts under ``set_sync_debug_mode("error")``."""
    _needs_grouped_mm()
    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 9, 2], device="cuda")
    w1 = torch.randn(4, 64, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w2 = torch.randn(4, 32, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b1 = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(16, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    runtime = CommRuntime(delay_wgrad=True)
    grouped_mlp(x, counts, w1, w2, torch.nn.functional.silu, runtime, gate_up_bias=b1)  # warm-up (lazy init)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = grouped_mlp(x, counts, w1, w2, torch.nn.functional.silu, runtime, gate_up_bias=b1)
        y.backward(torch.ones_like(y))
        runtime.flush_wgrad()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    assert w1.grad is not None and b1.grad is not None
