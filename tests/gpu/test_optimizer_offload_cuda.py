"""``OffloadedOptimizer`` on CUDA: pinned host buffers, asynchronous copies, state on the GPU and the host by the
fraction, counted by each tensor's own device; the update within float32 rounding of the plain optimizer's (the
host runs torch's CPU AdamW kernel, the device its CUDA one)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_moe_overlap.optim import offload, state_bytes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="Requires: CUDA (pinned memory, copies to the host)"),
]


def _train(model: nn.Module, optimizer, steps: int = 5) -> None:
    data = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 64, device="cuda", generator=data)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 8)).cuda()


def _bytes_by_device(optimizer) -> dict[str, int]:
    out: dict[str, int] = {}
    for entry in optimizer.state.values():
        for value in entry.values():
            if isinstance(value, torch.Tensor):
                out[value.device.type] = out.get(value.device.type, 0) + value.numel() * value.element_size()
    return out


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_cuda_offload_matches_and_moves_state_to_pinned_host_memory(fraction):
    plain, offloaded = _model(), _model()
    reference = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    wrapped = offload(torch.optim.AdamW(offloaded.parameters(), lr=1e-2), fraction, torch.device("cuda"))
    _train(plain, reference)
    _train(offloaded, wrapped)
    torch.cuda.synchronize()
    for a, b in zip(offloaded.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    on_gpu, total = _bytes_by_device(wrapped).get("cuda", 0), _bytes_by_device(reference)["cuda"]
    assert on_gpu <= (1 - fraction) * total  # the moments of at least `fraction` of the elements left the GPU
    assert state_bytes(wrapped).host >= fraction * total
    assert all(c.master.is_pinned() and c.master.grad.is_pinned() for c in wrapped.copies.values())
