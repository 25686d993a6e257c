"""mesh_layout: the mesh's dimensions reproduce ParallelDims' rank layout, checked without a process group.

The oracle is ``ParallelDims`` itself: a row-major grid of the global ranks in the mesh's shape, read along each
kind's view, must give exactly ``group_ranks(kind)``, and each rank's index along the view its coordinate there.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_moe_overlap.parallel import ParallelDims
from lightning_moe_overlap.parallel.dims import GROUP_KINDS
from lightning_moe_overlap.parallel.mesh import MeshLayout, ParallelMesh, build_mesh, mesh_layout


def _all_dims(max_world: int) -> list[ParallelDims]:
    out = []
    for world in range(1, max_world + 1):
        for tp in (1, 2):
            for pp in (1, 2):
                for cp in (1, 2, 3, 4):
                    if world % (tp * pp * cp):
                        continue
                    block = world // (tp * pp)
                    for ep in (e for e in range(1, block + 1) if block % e == 0):
                        out.append(ParallelDims.from_world_size(world, tp=tp, pp=pp, cp=cp, ep=ep))
    return out


def _nested(dims: ParallelDims) -> bool:
    """Whether the innermost ``ep`` ranks of the dp x cp x tp block are whole dimensions and a divisor of one."""
    need = dims.ep
    for size in (dims.tp, dims.cp, dims.dp):
        if need % size == 0:
            need //= size
        elif size % need == 0:
            return True
        else:
            return False
    return need == 1


def _view_groups(layout: MeshLayout, kind: str) -> list[list[int]]:
    """The groups of ``kind`` read off a row-major grid of the ranks: its view's dimensions last, the rest first."""
    grid = torch.arange(math.prod(layout.shape)).reshape(layout.shape)
    view = [layout.names.index(name) for name in layout.views[kind]]
    assert view == sorted(view), (kind, layout)  # a view keeps the mesh's order of its dimensions
    rest = [d for d in range(len(layout.shape)) if d not in view]
    size = math.prod(layout.shape[d] for d in view)
    return grid.permute(*rest, *view).reshape(-1, size).tolist()


def _coordinate(dims: ParallelDims, kind: str, rank: int) -> int:
    c = dims.coords(rank)
    if kind == "dp_cp":
        return c.dp * dims.cp + c.cp
    if kind == "dp_cp_tp":
        return (c.dp * dims.cp + c.cp) * dims.tp + c.tp
    if kind == "cp_tp":
        return c.cp * dims.tp + c.tp
    return getattr(c, kind)


def test_the_sweep_reaches_tensor_parallel_folds() -> None:
    folded = [d for d in ALL if d.tp > 1 and d.ep > 1 and _nested(d)]
    assert any(d.ep % d.tp == 0 for d in folded) and any(d.tp % d.ep == 0 and d.ep < d.tp for d in ALL if d.tp > 1)


ALL = _all_dims(16)


@pytest.mark.parametrize("dims", [d for d in ALL if _nested(d)], ids=lambda d: d.describe())
def test_mesh_views_are_the_layouts_groups_in_coordinate_order(dims: ParallelDims) -> None:
    layout = mesh_layout(dims)
    assert math.prod(layout.shape) == dims.world_size
    assert len(set(layout.names)) == len(layout.names)
    assert set(layout.views) == set(GROUP_KINDS)
    for kind in GROUP_KINDS:
        parts = layout.views[kind]
        assert parts and all(part in layout.names for part in parts), (kind, parts)
        groups = _view_groups(layout, kind)
        assert sorted(groups) == sorted(dims.group_ranks(kind)), (kind, dims.describe(), layout)
        for group in groups:
            assert [_coordinate(dims, kind, r) for r in group] == list(range(len(group))), (kind, group)


def test_mesh_layout_forms() -> None:
    ep_over_tp = mesh_layout(ParallelDims.from_world_size(16, tp=2, pp=2, cp=2, ep=4))  # dp=2: ep = cp x tp
    assert ep_over_tp.names == ("pp", "dp", "cp", "tp", "unit")
    assert ep_over_tp.shape == (2, 2, 2, 2, 1)
    assert ep_over_tp.views["ep"] == ("cp", "tp") and ep_over_tp.views["edp"] == ("dp",)
    ep_in_cp = mesh_layout(ParallelDims.from_world_size(16, cp=4, ep=2))  # dp=4, cp=4, ep=2, edp=8
    assert ep_in_cp.names == ("pp", "dp", "cp_edp", "cp_ep", "tp", "unit")
    assert ep_in_cp.shape == (1, 4, 2, 2, 1, 1)
    assert ep_in_cp.views["cp"] == ("cp_edp", "cp_ep") and ep_in_cp.views["edp"] == ("dp", "cp_edp")
    assert ep_in_cp.views["dp_cp"] == ("dp", "cp_edp", "cp_ep") and ep_in_cp.views["ep"] == ("cp_ep", "tp")
    plain = mesh_layout(ParallelDims.from_world_size(8, ep=4))  # the common case: cp=1, tp=1, ep inside dp
    assert plain.names == ("pp", "dp_edp", "dp_ep", "cp", "tp", "unit") and plain.shape == (1, 2, 4, 1, 1, 1)
    ep_in_tp = mesh_layout(ParallelDims.from_world_size(8, tp=4, ep=2))  # dp=2: ep pairs inside each tp group
    assert ep_in_tp.views["tp"] == ("tp_edp", "tp_ep") and ep_in_tp.views["ep"] == ("tp_ep",)
    alone = mesh_layout(ParallelDims.from_world_size(2))  # ep=1: a size-1 ep dimension of its own
    assert alone.views["ep"] == ("ep",) and alone.shape[alone.names.index("ep")] == 1


def test_mesh_layout_refuses_ep_groups_that_cut_a_dimension_unevenly() -> None:
    unnested = [d for d in ALL if not _nested(d)]
    assert unnested  # the sweep reaches such sizes (cp=2, ep=3 on 12 ranks, cp=4, ep=6 on 12, ...)
    dims = ParallelDims.from_world_size(12, cp=2, ep=3)
    rule = r"ep=3 .* cannot be one DeviceMesh.*with cp=2.*\[1, 2, 4, 6, 12\]"
    with pytest.raises(NotImplementedError, match=rule):
        mesh_layout(dims)
    with pytest.raises(NotImplementedError, match=r"cannot be one DeviceMesh"):
        build_mesh(dims, "cpu")  # refused before any process group is needed
    for dims in unnested:
        with pytest.raises(NotImplementedError, match=rf"ep={dims.ep} "):
            mesh_layout(dims)


def test_build_mesh_needs_the_dims_world() -> None:
    with pytest.raises(RuntimeError, match=r"world_size=4 but the default process group has world_size=None"):
        build_mesh(ParallelDims.from_world_size(4, ep=2), "cpu")


def test_parallel_mesh_refuses_an_unknown_kind() -> None:
    dims = ParallelDims.from_world_size(1)
    mesh = ParallelMesh(dims=dims, layout=mesh_layout(dims), device_mesh=None, views={})  # type: ignore[arg-type]
    with pytest.raises(KeyError, match=r"unknown kind='expert'; valid kinds: \['dp', 'cp', 'dp_cp'"):
        mesh["expert"]  # type: ignore[index]
