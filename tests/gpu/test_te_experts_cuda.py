"""``expert_backend="te"`` on CUDA: Transformer Engine's ``GroupedLinear`` against the pure-PyTorch experts.

Same weights, same routed rows: forward, input gradient and weight gradients (accumulated over two
micro-batches, inline and through ``delay_wgrad`` / ``backward_dw``) agree within bf16 tolerance, in bf16 and
under bf16 autocast with fp32 weights (bf16-mixed).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from lightning_moe_overlap.moe.ep import apply_expert_parallel
from lightning_moe_overlap.moe.experts import Experts
from lightning_moe_overlap.overlap.runtime import CommRuntime

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None,
        reason="Requires: CUDA and transformer-engine (the `te` extra)",
    ),
]

E, D, F, T, K = 8, 128, 256, 96, 2


class Holder(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.experts = Experts(E, D, F, device="cuda", dtype=dtype, init_std=0.05)


def _run(backend: str, dtype: torch.dtype, autocast: bool, delay: bool) -> list[torch.Tensor]:
    holder, runtime = Holder(dtype), CommRuntime(delay_wgrad=delay)
    (ep,) = apply_expert_parallel(holder, None, runtime=runtime, expert_backend=backend)
    g = torch.Generator(device="cuda").manual_seed(1)
    outs = []
    for _ in range(2):  # two micro-batches accumulate into .grad
        x = torch.randn(T, D, device="cuda", generator=g).to(dtype).requires_grad_()
        idx = torch.randint(0, E - 1, (T, K), device="cuda", generator=g)  # expert E-1 gets no rows
        w = torch.rand(T, K, device="cuda", generator=g).to(dtype)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = holder.experts(x, idx, w)
        out.float().square().sum().backward()
        runtime.flush_wgrad()
        outs += [out.detach().float(), x.grad.float()]
    return outs + [ep.gate_up_proj.grad.float(), ep.down_proj.grad.float()]


@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize(("dtype", "autocast"), [(torch.bfloat16, False), (torch.float32, True)], ids=["bf16", "bf16-mixed"])
def test_te_experts_match_torch_experts(dtype: torch.dtype, autocast: bool, delay: bool) -> None:
    want = _run("torch", dtype, autocast, delay=False)
    got = _run("te", dtype, autocast, delay)
    names = ["out0", "dx0", "out1", "dx1", "d_gate_up", "d_down"]
    for name, a, b in zip(names, got, want):
        scale = b.abs().max().clamp_min(1e-6)
        assert ((a - b).abs().max() / scale) < 2e-2, name
    assert got[-2][E - 1].abs().sum() == 0  # no rows: zero weight gradient
