"""The ep groups get NCCL's high-priority stream; every other group, and every group on gloo, gets no options.

The groups are the mesh's (``build_mesh``, where the strategy, the tests and the benchmarks get them): in a pretend
4-rank world, the backend config of every mesh group (each dimension's, each flattened view's) is recorded by name
instead of a group being made.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from lightning_moe_overlap.parallel import ParallelDims, build_mesh
from lightning_moe_overlap.parallel import mesh as mesh_module
from lightning_moe_overlap.parallel.dims import GROUP_KINDS
from lightning_moe_overlap.parallel.groups import group_options


class _FakeNCCL:
    """Stands in for ``ProcessGroupNCCL`` (absent from CPU builds of torch)."""

    class Options:
        def __init__(self) -> None:
            self.is_high_priority_stream = False


class _FakeRoot:
    """Stands in for the root ``DeviceMesh``: slicing returns itself."""

    def __getitem__(self, names: Any) -> _FakeRoot:
        return self


def _recording(monkeypatch: pytest.MonkeyPatch, backend: str) -> dict[str, tuple[str, Any]]:
    """Pretend an initialised 4-rank world on ``backend``; record ``{mesh group name: (backend, options)}``."""
    configs: dict[str, tuple[str, Any]] = {}

    def init_device_mesh(device_type, shape, *, mesh_dim_names, backend_override):
        configs.update(backend_override)
        return _FakeRoot()

    def flatten_mesh(mesh, name, backend_override=None):
        configs[name] = backend_override
        return mesh

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", _FakeNCCL, raising=False)
    monkeypatch.setattr(mesh_module, "init_device_mesh", init_device_mesh)
    monkeypatch.setattr(mesh_module.torch_compat, "flatten_mesh", flatten_mesh)
    return configs


@pytest.mark.parametrize("explicit", [True, False], ids=["backend-argument", "default-group-backend"])
def test_nccl_ep_group_has_a_high_priority_stream(monkeypatch: pytest.MonkeyPatch, explicit: bool) -> None:
    configs = _recording(monkeypatch, "nccl")
    dims = ParallelDims.from_world_size(4, ep=2)
    build_mesh(dims, "cuda", backend="nccl" if explicit else None)
    assert mesh_module.mesh_layout(dims).views["ep"] == ("dp_ep", "cp", "tp")  # ep is a flattened view: "ep"
    with_options = {name: options for name, (_, options) in configs.items() if options is not None}
    assert list(with_options) == ["ep"]
    assert isinstance(with_options["ep"], _FakeNCCL.Options) and with_options["ep"].is_high_priority_stream
    assert all(backend == "nccl" for backend, _ in configs.values())


def test_gloo_groups_get_no_options(monkeypatch: pytest.MonkeyPatch) -> None:
    configs = _recording(monkeypatch, "gloo")
    build_mesh(ParallelDims.from_world_size(4, ep=2), "cpu", backend="gloo")
    assert configs and all(options is None for _, options in configs.values())


@pytest.mark.parametrize("kind", [k for k in GROUP_KINDS if k != "ep"])
def test_only_the_ep_kind_has_options(kind: str) -> None:
    assert group_options(kind, "nccl") is None
