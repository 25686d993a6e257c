"""Expert parallelism's CUDA path with more than one rank: 2 processes share ``cuda:0`` over gloo (NCCL refuses
two ranks on one device), ``ep=2``, top-8 routing over 16 experts, grouped GEMM, plain and deduplicated dispatch.

The CPU suite never runs the ep > 1 path with CUDA tensors (device-side counts, the row regrouping after the
all-to-all, ``torch._grouped_mm`` on the GPU). Oracle: each rank also runs the full, unsharded experts with the
loop GEMM on its own tokens, in float64 on the CPU; outputs and every gradient must match (expert gradients
summed over the ranks), and the deduplicated dispatch must send fewer rows than the plain one.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_moe_overlap.moe import Experts, apply_expert_parallel
from lightning_moe_overlap.overlap.observers import CommTraffic
from lightning_moe_overlap.overlap.runtime import CommRuntime
from tests.helpers.distributed import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="Requires: CUDA (two ranks on cuda:0)"),
]

E, D, F, TOP_K, TOKENS = 16, 64, 32, 8, 96


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(TOKENS + 7 * rank, D, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(x.shape[0])])
    w = torch.rand(x.shape[0], TOP_K, generator=g)
    return x, idx, w, torch.randn(x.shape, generator=g)


def _worker(rank: int, world: int, dedup: bool, impl: str) -> dict:
    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    full = Experts(E, D, F, impl="loop", dtype=torch.float64)  # the oracle: CPU, float64, no sharding
    x, idx, w, grad_out = _inputs(rank)
    x_ref, w_ref = x.double().requires_grad_(), w.double().requires_grad_()
    full(x_ref, idx, w_ref).backward(grad_out.double())

    model = nn.ModuleDict({"experts": copy.deepcopy(full).float()}).cuda()
    runtime, traffic = CommRuntime(), CommTraffic()
    runtime.attach(traffic)
    (ep,) = apply_expert_parallel(model, dist.group.WORLD, runtime=runtime, impl=impl, dedup=dedup)
    x_ep = x.cuda().requires_grad_()
    w_ep = w.cuda().requires_grad_()
    out = ep(x_ep, idx.cuda(), w_ep)
    out.backward(grad_out.cuda())
    torch.cuda.synchronize()
    ref_out = full(x.double(), idx, w.double()).detach()
    tol = {"atol": 2e-4, "rtol": 2e-4}
    torch.testing.assert_close(out.cpu().double(), ref_out, **tol)
    torch.testing.assert_close(x_ep.grad.cpu().double(), x_ref.grad, **tol)
    torch.testing.assert_close(w_ep.grad.cpu().double(), w_ref.grad, **tol)
    for name in ("gate_up_proj", "down_proj"):
        mine = getattr(ep, name).grad.cpu()
        parts = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine)
        summed = getattr(full, name).grad.clone()
        dist.all_reduce(summed)
        torch.testing.assert_close(torch.cat(parts).double(), summed, **tol, msg=name)
    return {"remote_bytes": traffic.remote_bytes, "device": str(out.device)}


@pytest.mark.parametrize("impl", ["grouped_mm", "loop"])
def test_ep2_on_one_gpu_matches_the_unsharded_float64_experts(impl: str) -> None:
    sent = {}
    for dedup in (False, True):
        results = run_distributed(_worker, 2, dedup, impl, timeout_s=120)
        assert all(r["device"] == "cuda:0" for r in results)
        sent[dedup] = sum(r["remote_bytes"] for r in results)
    assert 0 < sent[True] < sent[False], sent  # top-8 over 2 ranks: many choices share a rank
