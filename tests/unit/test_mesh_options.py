"""The one mesh's groups: every group carries the strategy's timeout, and the ep groups on NCCL get the
high-priority stream, whether ep is a dimension of the mesh or a flattened view of two."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_moe_overlap.parallel import ParallelDims, build_mesh
from lightning_moe_overlap.parallel import mesh as mesh_module
from lightning_moe_overlap.parallel.dims import GROUP_KINDS


def test_every_group_of_the_mesh_has_the_timeout(world_of_one) -> None:
    mesh = build_mesh(ParallelDims.from_world_size(1), "cpu", timeout=timedelta(seconds=7))
    for kind in GROUP_KINDS:
        backend = mesh.group(kind)._get_backend(torch.device("cpu"))
        assert backend.options._timeout == timedelta(seconds=7), kind


def test_groups_are_the_views_groups(world_of_one) -> None:
    mesh = build_mesh(ParallelDims.from_world_size(1), "cpu")
    groups = mesh.process_groups(0)
    for kind in GROUP_KINDS:
        assert getattr(groups, kind) is mesh[kind].get_group(), kind


class _FakeNCCLOptions:
    def __init__(self) -> None:
        self.is_high_priority_stream = False
        self._timeout = None


class _FakeRoot:
    """Stands in for the root ``DeviceMesh``: slicing returns itself."""

    def __getitem__(self, names: Any) -> _FakeRoot:
        return self


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A pretend 4-rank NCCL world; what ``init_device_mesh`` and each flatten were asked for, by name."""
    seen: dict[str, Any] = {}

    def init_device_mesh(device_type, shape, *, mesh_dim_names, backend_override):
        seen.update(backend_override)
        return _FakeRoot()

    def flatten_mesh(mesh, name, backend_override=None):
        seen[name] = backend_override
        return mesh

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "ProcessGroupNCCL", type("PG", (), {"Options": _FakeNCCLOptions}), raising=False)
    monkeypatch.setattr(mesh_module, "init_device_mesh", init_device_mesh)
    monkeypatch.setattr(mesh_module.torch_compat, "flatten_mesh", flatten_mesh)
    return seen


@pytest.mark.parametrize(("cp", "ep", "ep_parts"), [(2, 2, ("cp", "tp")), (1, 2, ("dp_ep", "cp", "tp")), (2, 4, ("dp", "cp", "tp"))])
def test_nccl_ep_groups_get_the_high_priority_stream(recorded, cp: int, ep: int, ep_parts: tuple) -> None:
    dims = ParallelDims.from_world_size(4, cp=cp, ep=ep)
    build_mesh(dims, "cuda", timeout=timedelta(seconds=9))
    assert mesh_module.mesh_layout(dims).views["ep"] == ep_parts
    backend, options = recorded["ep"]
    assert backend == "nccl" and options.is_high_priority_stream and options._timeout == timedelta(seconds=9)
    others = {name: config for name, config in recorded.items() if name != "ep"}
    assert others and all(not opts.is_high_priority_stream for _, opts in others.values()), others
    assert all(opts._timeout == timedelta(seconds=9) for _, opts in others.values())
