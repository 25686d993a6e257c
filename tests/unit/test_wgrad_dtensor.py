"""Delayed weight gradients of ``DTensor`` experts (the ep mesh): the GEMMs wait in the runtime's queue, land in the
``DTensor`` parameter's local gradient when it runs, and equal the inline ones bitwise, over two backward passes."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from lightning_moe_overlap.moe.ep import apply_expert_parallel
from lightning_moe_overlap.moe.experts import Experts
from lightning_moe_overlap.moe.grouped import RowSplits, grouped_projection
from lightning_moe_overlap.overlap.runtime import CommRuntime

T, K, D, F, E = 7, 2, 8, 6, 4


def _experts(delay: bool) -> tuple[nn.Module, CommRuntime]:
    torch.manual_seed(0)
    holder = nn.Module()
    holder.experts = Experts(E, D, F, dtype=torch.float64)
    runtime = CommRuntime(delay_wgrad=delay)
    apply_expert_parallel(holder, None, runtime=runtime, ep_mesh=init_device_mesh("cpu", (1,), mesh_dim_names=("ep",)))
    return holder, runtime


def _backward(holder: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    holder.experts(x, idx, torch.rand(T, K, generator=g, dtype=torch.float64)).square().sum().backward()


def test_dtensor_expert_wgrads_wait_in_the_queue_and_equal_inline(world_of_one) -> None:
    inline, _ = _experts(delay=False)
    delayed, runtime = _experts(delay=True)
    for seed in (1, 2):  # the second pass accumulates into the existing DTensor gradient
        _backward(inline, seed)
        _backward(delayed, seed)
        # fc1's wgrad, the last of the backward, waits for the next comm point (inline, it would be done).
        assert runtime.pending_wgrad >= 1
        if seed == 1:
            assert delayed.experts.gate_up_proj.grad is None
        runtime.flush_wgrad()
        assert runtime.pending_wgrad == 0
    for (name, want), got in zip(inline.named_parameters(), delayed.parameters(), strict=True):
        assert isinstance(got.grad, DTensor) and got.grad.placements == (Shard(0),), name
        assert torch.equal(got.grad.to_local(), want.grad.to_local()), name


def test_a_grad_target_that_is_not_the_weights_parameter_is_refused() -> None:
    parameter = nn.Parameter(torch.randn(2, 3, 4))
    rule = r"local shard of shape \(2, 3, 4\).*\(2, 4, 3\).*weight == local\(grad_target\)"
    with pytest.raises(ValueError, match=rule):
        grouped_projection(
            torch.randn(5, 3), torch.randn(2, 4, 3, requires_grad=True), RowSplits.of([2, 3]), grad_target=parameter
        )
