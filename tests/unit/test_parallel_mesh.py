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
    return dims.cp % dims.ep == 0 or dims.ep % dims.cp == 0


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
    return c.dp * dims.cp + c.cp if kind == "dp_cp" else getattr(c, kind)


ALL = _all_dims(16)


@pytest.mark.parametrize("dims", [d for d in ALL if _nested(d)], ids=lambda d: d.describe())
def test_mesh_views_are_the_layouts_groups_in_coordinate_order(dims: ParallelDims) -> None:
    layout = mesh_layout(dims)
    assert math.prod(layout.shape) == dims.world_size
    assert len(set(layout.names)) == len(layout.names)
    assert set(layout.views) == set(GROUP_KINDS)
    for kind in GROUP_KINDS:
        parts = layout.views[kind]
        assert len(parts) > 1 or parts == (kind,), (kind, parts)  # a one-dimension view is the dimension of its name
        groups = _view_groups(layout, kind)
        assert sorted(groups) == sorted(dims.group_ranks(kind)), (kind, dims.describe(), layout)
        for group in groups:
            assert [_coordinate(dims, kind, r) for r in group] == list(range(len(group))), (kind, group)


def test_mesh_layout_forms() -> None:
    cp_inside = mesh_layout(ParallelDims.from_world_size(16, tp=2, pp=2, cp=2, ep=4))  # dp=2, block 4 = ep
    assert cp_inside.names == ("pp", "edp", "dp_in_ep", "cp", "tp")
    assert cp_inside.shape == (2, 1, 2, 2, 2)
    assert cp_inside.views["dp"] == ("edp", "dp_in_ep") and cp_inside.views["ep"] == ("dp_in_ep", "cp")
    ep_inside = mesh_layout(ParallelDims.from_world_size(16, cp=4, ep=2))  # dp=4, cp=4, ep=2, edp=8
    assert ep_inside.names == ("pp", "dp", "cp_in_edp", "ep", "tp")
    assert ep_inside.shape == (1, 4, 2, 2, 1)
    assert ep_inside.views["cp"] == ("cp_in_edp", "ep") and ep_inside.views["edp"] == ("dp", "cp_in_edp")
    assert ep_inside.views["dp_cp"] == ("dp", "cp_in_edp", "ep")
    plain = mesh_layout(ParallelDims.from_world_size(8, ep=4))  # the common case: cp=1, ep inside dp
    assert plain.shape == (1, 2, 4, 1, 1) and plain.names[1:4] == ("edp", "dp_in_ep", "cp")


def test_mesh_layout_refuses_cp_and_ep_that_do_not_nest() -> None:
    unnested = [d for d in ALL if not _nested(d)]
    assert unnested  # the sweep reaches such sizes (cp=2, ep=3 on 12 ranks, cp=4, ep=6 on 12, ...)
    dims = ParallelDims.from_world_size(12, cp=2, ep=3)
    rule = r"cp=2 and ep=3 .* one of cp and ep divides the other.*\[1, 2, 4, 6, 12\]"
    with pytest.raises(NotImplementedError, match=rule):
        mesh_layout(dims)
    with pytest.raises(NotImplementedError, match=r"cannot be one DeviceMesh"):
        build_mesh(dims, "cpu")  # refused before any process group is needed
    for dims in unnested:
        with pytest.raises(NotImplementedError, match=rf"cp={dims.cp} and ep={dims.ep} "):
            mesh_layout(dims)


def test_build_mesh_needs_the_dims_world() -> None:
    with pytest.raises(RuntimeError, match=r"world_size=4 but the default process group has world_size=None"):
        build_mesh(ParallelDims.from_world_size(4, ep=2), "cpu")


def test_parallel_mesh_refuses_an_unknown_kind() -> None:
    dims = ParallelDims.from_world_size(1)
    mesh = ParallelMesh(dims=dims, layout=mesh_layout(dims), device_mesh=None, views={})  # type: ignore[arg-type]
    with pytest.raises(KeyError, match=r"unknown kind='expert'; valid kinds: \['dp', 'cp', 'dp_cp'"):
        mesh["expert"]  # type: ignore[index]
