"""``ShardedModel`` on one process: the step defers FSDP's reduction to ``end_step`` and leaves ignored parameters
alone; the gathered parameters are plain tensors (the model's submodules can be called directly)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_moe_overlap.parallel import ParallelDims, build_mesh
from lightning_moe_overlap.parallelize.sharding import ShardedModel, replicate_mesh


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def test_step_accumulates_then_reduces_once_and_ignores_given_parameters(world_of_one) -> None:
    model, reference = _model(), _model()
    mesh = replicate_mesh(build_mesh(ParallelDims.from_world_size(1), "cpu"))
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


@pytest.mark.parametrize("mode", ["optimizer", "full"])
def test_sharded_modes_gather_once_keep_hooks_idle_and_reduce_once(world_of_one, mode) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    from lightning_moe_overlap.parallel import build_mesh

    model, reference = _model(), _model()
    mesh = build_mesh(ParallelDims.from_world_size(1), "cpu")
    sharded = ShardedModel.shard(model, [model[2]], mesh, mode)  # model[2] stands in for an experts module
    assert sharded.sharded and all(isinstance(p, DTensor) for p in sharded.parameters)
    assert tuple(model[2].weight.device_mesh.mesh_dim_names) == ("edp",)
    states = fully_shard.state(model)._state_ctx.all_states
    for step in range(2):
        sharded.begin_step()
        assert {s._training_state for s in states} == {TrainingState.PRE_BACKWARD}  # hooks idle for the step
        assert not any(isinstance(p, DTensor) for p in model.parameters())  # gathered
        for x in (torch.randn(5, 3), torch.randn(5, 3)):
            model(x).square().mean().backward()
            reference(x).square().mean().backward()
        sharded.end_step()
        assert {s._training_state for s in states} == {TrainingState.IDLE}
        assert all(isinstance(p, DTensor) for p in model.parameters())  # resharded after the reduction
        for got, want in zip(sharded.parameters, reference.parameters(), strict=True):
            torch.testing.assert_close(got.grad.to_local(), want.grad, rtol=0, atol=1e-7)
            got.grad, want.grad = None, None
        sharded.after_optimizer_step()  # "optimizer": gathered again at rest; "full": stays sharded
        assert all(isinstance(p, DTensor) != (mode == "optimizer") for p in model.parameters())
