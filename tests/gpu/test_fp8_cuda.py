"""FP8 on CUDA against the CPU reference: the experts' FP8 kernel on the same inputs (the quantisation is the same
element-wise float32 arithmetic on both devices, only the GEMMs' accumulation order differs), delayed wgrad bitwise
equal to inline on the GPU, and a MoEGPT with torchao's dense linears and the FP8 experts training on the GPU."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.fp8 import RECIPES, Float8ExpertsKernel, apply_fp8
from lightning_moe_overlap.moe import Experts
from lightning_moe_overlap.overlap.runtime import CommRuntime
from tests.unit.test_fp8_gemm import sqnr_db

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="Requires: CUDA with FP8 GEMMs (compute capability >= 8.9)",
    ),
]

E, D, F, T, K = 4, 64, 32, 96, 2


def _inputs(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, E - 1, (T, K), generator=g)  # expert E-1: no tokens
    return torch.randn(T, D, generator=g), idx, torch.rand(T, K, generator=g), torch.randn(T, D, generator=g)


def _run(experts: Experts, x, idx, w, g_out) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    out = experts(x, idx, w)
    out.backward(g_out)
    return [out.detach().float().cpu(), x.grad.float().cpu(), experts.gate_up_proj.grad.float().cpu(),
            experts.down_proj.grad.float().cpu()]  # fmt: skip


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_fp8_experts_match_the_cpu_reference(recipe: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    cpu = Experts(E, D, F, init_std=0.1, dtype=dtype)
    cpu.kernel = Float8ExpertsKernel(RECIPES[recipe])
    cuda = copy.deepcopy(cpu).cuda()
    x, idx, w, g_out = _inputs(1)
    on_cpu = _run(cpu, x.to(dtype), idx, w.to(dtype), g_out.to(dtype))
    on_cuda = _run(cuda, x.to(dtype).cuda(), idx.cuda(), w.to(dtype).cuda(), g_out.to(dtype).cuda())
    for name, ref, got in zip(("out", "dx", "d_gate_up", "d_down"), on_cpu, on_cuda):
        assert sqnr_db(ref, got) >= (50.0 if dtype == torch.float32 else 35.0), (recipe, name)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_cuda_delayed_wgrad_is_bitwise_the_inline_wgrad(recipe: str) -> None:
    x, idx, w, g_out = (t.cuda() for t in _inputs(2))
    grads = []
    for delay in (False, True):
        torch.manual_seed(0)
        runtime = CommRuntime(delay_wgrad=delay)
        experts = Experts(E, D, F, runtime=runtime, device="cuda", dtype=torch.bfloat16)
        experts.kernel = Float8ExpertsKernel(RECIPES[recipe])
        experts(x.bfloat16(), idx, w.bfloat16()).backward(g_out.bfloat16())
        assert runtime.pending_wgrad == (2 if delay else 0)
        runtime.flush_wgrad()
        grads.append((experts.gate_up_proj.grad, experts.down_proj.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_cuda_moegpt_in_fp8_tracks_bf16(recipe: str) -> None:
    pytest.importorskip("torchao.float8", reason="Requires: torchao (the fp8 extra)")
    reference = MoEGPT(vocab_size=256, hidden_size=128, num_layers=2, num_heads=4, ffn_hidden_size=128).cuda()
    model = copy.deepcopy(reference)
    report = apply_fp8(model, recipe)
    assert len(report.linears) == 4 and len(report.experts) == 2
    tokens = torch.randint(0, 256, (4, 65), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits_ref, logits = reference(tokens), model(tokens)
    assert sqnr_db(logits_ref.float().cpu(), logits.float().cpu()) >= 15.0
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model._loss(tokens)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
