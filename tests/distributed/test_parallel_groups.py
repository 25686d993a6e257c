"""The mesh's process groups on real gloo ranks: every rank lands in the groups the pure layout says, they
communicate, and each 1-D view of the mesh is the group of its kind, with this rank at its coordinate there."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_moe_overlap.parallel import ParallelDims
from lightning_moe_overlap.parallel.dims import GROUP_KINDS
from lightning_moe_overlap.parallel.mesh import ParallelMesh, build_mesh
from tests.helpers.distributed import run_distributed

SHAPES = {  # world -> list of (tp, pp, cp, ep)
    1: [(1, 1, 1, 1)],
    4: [(1, 1, 1, 2), (2, 1, 1, 2), (1, 2, 1, 2), (1, 1, 2, 4), (1, 1, 2, 1)],
    8: [(2, 1, 2, 2), (1, 2, 1, 4), (2, 2, 1, 2), (1, 1, 1, 8), (1, 1, 2, 4)],
}


def _worker_groups(rank: int, world: int, shapes: list[tuple[int, int, int, int]]) -> int:
    checked = 0
    for tp, pp, cp, ep in shapes:
        dims = ParallelDims.from_world_size(world, tp=tp, pp=pp, cp=cp, ep=ep)
        mesh = build_mesh(dims, "cpu")
        groups = mesh.process_groups(rank)  # as the strategy gets them
        if tp == 1:
            assert groups.dp_cp_tp is groups.dp_cp, dims  # the same ranks: the mesh makes no second communicator
        if cp == 1 or tp == 1:
            assert groups.cp_tp is (groups.tp if cp == 1 else groups.cp), dims  # likewise
        for kind in GROUP_KINDS:
            group = getattr(groups, kind)
            expected = dims.group_of(kind, rank)
            assert dist.get_process_group_ranks(group) == expected, (kind, rank, dims)
            total = torch.tensor([float(rank)])
            dist.all_reduce(total, group=group)  # the group really connects exactly those ranks
            assert total.item() == float(sum(expected)), (kind, rank)
            checked += 1
        assert groups.coords == dims.coords(rank)
        checked += _check_mesh(dims, rank, mesh)
    return checked


def _check_mesh(dims: ParallelDims, rank: int, mesh: ParallelMesh) -> int:
    """The mesh's view of each kind is the group of that kind, its members in coordinate order, and this rank's
    index in it is its coordinate there; one all-reduce over the flattened views proves they connect those ranks."""
    groups = mesh.process_groups(rank)
    coords = dims.coords(rank)
    for kind in GROUP_KINDS:
        view = mesh[kind]
        members = dist.get_process_group_ranks(view.get_group())
        assert view.get_group() is getattr(groups, kind), (kind, rank, dims)
        assert members == dims.group_of(kind, rank), (kind, rank, dims, members)
        assert view.mesh.tolist() == members, (kind, rank, view)
        block = coords.dp * dims.cp + coords.cp
        by_kind = {"dp_cp": block, "dp_cp_tp": block * dims.tp + coords.tp, "cp_tp": coords.cp * dims.tp + coords.tp}
        expected = by_kind[kind] if kind in by_kind else getattr(coords, kind)
        assert view.get_local_rank() == expected, (kind, rank, dims)
    for kind in ("dp_cp", "cp_tp", "dp_cp_tp", "ep", "edp"):  # the views the sharding, routers and token counts use
        total = torch.tensor([float(rank)])
        dist.all_reduce(total, group=mesh.group(kind))
        assert total.item() == float(sum(dims.group_of(kind, rank))), (kind, rank, dims)
    return 1


def test_groups_single_process():
    assert run_distributed(_worker_groups, 1, SHAPES[1]) == [len(GROUP_KINDS) + 1]


@pytest.mark.long  # the groups of one mesh at 4 ranks are also checked by test_one_mesh.py
def test_groups_four_ranks():
    assert run_distributed(_worker_groups, 4, SHAPES[4]) == [5 * (len(GROUP_KINDS) + 1)] * 4


@pytest.mark.procs8  # 8 processes: `python -m pytest -m procs8`
def test_groups_eight_ranks():
    assert run_distributed(_worker_groups, 8, SHAPES[8], timeout_s=120) == [5 * (len(GROUP_KINDS) + 1)] * 8


def _worker_wrong_world(rank: int, world: int) -> None:
    build_mesh(ParallelDims.from_world_size(4, ep=2), "cpu")


def test_groups_refuse_dims_of_another_world():
    with pytest.raises(RuntimeError, match=r"built for world_size=4 but the default process group has world_size=2"):
        run_distributed(_worker_wrong_world, 2)
