"""Clipping on CUDA: the norm and the scaling never wait for the device (``set_sync_debug_mode("error")``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_moe_overlap.parallel.grads import clip_grad_norm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="Requires: CUDA (device-side gradient norm)"),
]


def test_clip_on_cuda_has_no_host_sync_and_matches_torch() -> None:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.zeros(s, device="cuda")) for s in [(64, 32), (32,), (4, 32, 16)]]
    for p in params:
        p.grad = torch.randn_like(p)
    reference = [nn.Parameter(p.detach().clone()) for p in params]
    for r, p in zip(reference, params, strict=True):
        r.grad = p.grad.clone()
    want = torch.nn.utils.clip_grad_norm_(reference, 0.5)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        norm = clip_grad_norm(params, 0.5, block=1, device=torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert norm.device.type == "cuda" and norm.dtype == torch.float64
    torch.testing.assert_close(norm.float(), want)
    for r, p in zip(reference, params, strict=True):
        torch.testing.assert_close(p.grad, r.grad)
