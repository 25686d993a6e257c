"""Experts as ``DTensor``s: with the ep mesh, ``ExpertParallelExperts`` registers its parameters as ``Shard(0)``
``DTensor``s of the global shape, computes exactly what the plain version computes, and gives ``DTensor`` gradients;
a mesh that is not the dispatcher's ep group is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from lightning_moe_overlap.moe.ep import apply_expert_parallel
from lightning_moe_overlap.moe.experts import Experts
from lightning_moe_overlap.overlap.runtime import CommRuntime

T, K, D, F, E = 7, 2, 8, 6, 4


def _holder() -> nn.Module:
    torch.manual_seed(0)
    holder = nn.Module()
    holder.experts = Experts(E, D, F, dtype=torch.float64)
    return holder


def _run(holder: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    out = holder.experts(x, idx, torch.rand(T, K, generator=g, dtype=torch.float64))
    out.square().sum().backward()
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in holder.parameters()]
    return out.detach(), grads


def test_parameters_are_shard0_dtensors_and_results_are_unchanged(world_of_one) -> None:
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    plain, sharded = _holder(), _holder()
    apply_expert_parallel(plain, None, runtime=CommRuntime())
    apply_expert_parallel(sharded, None, runtime=CommRuntime(), ep_mesh=mesh)
    for name, p in sharded.named_parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),) and p.shape[0] == E, name
    assert list(sharded.state_dict()) == list(plain.state_dict())
    out_plain, grads_plain = _run(plain)
    out_sharded, grads_sharded = _run(sharded)
    assert torch.equal(out_plain, out_sharded)
    for a, b in zip(grads_plain, grads_sharded):
        assert torch.equal(a, b)
    assert all(isinstance(p.grad, DTensor) for p in sharded.parameters())


def test_a_mesh_other_than_the_ep_group_is_refused(world_of_one) -> None:
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b"))
    with pytest.raises(ValueError, match=r"ep_mesh has shape \(1, 1\) .* Pass `ParallelMesh\['ep'\]`"):
        apply_expert_parallel(_holder(), None, runtime=CommRuntime(), ep_mesh=mesh)
