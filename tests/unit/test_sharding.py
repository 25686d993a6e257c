"""``ShardedModel`` on one process: the step defers FSDP's reduction to ``end_step`` and leaves ignored parameters
alone; the gathered parameters are plain tensors (the model's submodules can be called directly)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_moe_overlap.parallel import ParallelDims
from lightning_moe_overlap.parallel.sharding import ShardedModel, replicate_mesh


@pytest.fixture
def world_of_one(tmp_path):
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    if owned:
        dist.destroy_process_group()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def test_step_accumulates_then_reduces_once_and_ignores_given_parameters(world_of_one) -> None:
    model, reference = _model(), _model()
    mesh = replicate_mesh(ParallelDims.from_world_size(1), "cpu")
    assert mesh.mesh_dim_names == ("dp_cp", "unit") and tuple(mesh.shape) == (1, 1)
    ignored = model[2].weight
    sharded = ShardedModel.replicate([model], [ignored], mesh)
    assert isinstance(model[0].weight, DTensor) and not isinstance(model[2].weight, DTensor)
    sharded.begin_step()
    assert not isinstance(model[0].weight, DTensor)  # gathered: the plain tensors are registered
    inputs = [torch.randn(5, 3), torch.randn(5, 3)]
    for x in inputs:
        model(x).square().mean().backward()
        reference(x).square().mean().backward()
    sharded.end_step()
    assert isinstance(model[0].weight, DTensor)  # resharded after the reduction
    for got, want in zip(model.parameters(), reference.parameters()):
        grad = got.grad.to_local() if isinstance(got.grad, DTensor) else got.grad
        torch.testing.assert_close(grad, want.grad, rtol=0, atol=1e-7)
    sharded.release()  # mode "none": gathered again, callable by submodule
    assert not isinstance(model[0].weight, DTensor)
    model[0](torch.randn(2, 3))
