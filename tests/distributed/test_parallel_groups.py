"""build_groups and build_mesh on real gloo ranks: every rank lands in the groups the pure layout says, they
communicate, and each 1-D view of the mesh has exactly the members of the group of the same kind."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_moe_overlap.parallel import ParallelDims, build_groups
from lightning_moe_overlap.parallel.dims import GROUP_KINDS
from lightning_moe_overlap.parallel.mesh import build_mesh
from tests.helpers.distributed import run_distributed

SHAPES = {  # world -> list of (tp, pp, cp, ep)
    1: [(1, 1, 1, 1)],
    4: [(1, 1, 1, 2), (2, 1, 1, 2), (1, 2, 1, 2), (1, 1, 2, 4), (1, 1, 2, 1)],
    8: [(2, 1, 2, 2), (1, 2, 1, 4), (2, 2, 1, 2), (1, 1, 1, 8), (1, 1, 2, 4)],
}


def _worker_groups(rank: int, world: int, shapes: list[tuple[int, int, int, int]]) -> int:
    checked = 0
    created: list[list[int]] = []
    new_group = dist.new_group

    def counting_new_group(ranks, **kwargs):
        created.append(list(ranks))
        return new_group(ranks, **kwargs)

    dist.new_group = counting_new_group  # this worker process only
    for tp, pp, cp, ep in shapes:
        dims = ParallelDims.from_world_size(world, tp=tp, pp=pp, cp=cp, ep=ep)
        created.clear()
        groups = build_groups(dims, rank)
        # Built: one single-rank group when some kind has size 1, then each distinct partition once (ep apart).
        partitions = {
            (tuple(map(tuple, dims.group_ranks(k))), k == "ep") for k in GROUP_KINDS if len(dims.group_of(k, rank)) > 1
        }
        solo = any(len(dims.group_of(k, rank)) == 1 for k in GROUP_KINDS)
        assert len(created) == solo + sum(len(p) for p, _ in partitions), (dims, created)
        singles = {id(getattr(groups, k)) for k in GROUP_KINDS if len(dims.group_of(k, rank)) == 1}
        assert len(singles) <= 1, dims  # every size-1 kind is the same single-rank group
        if cp == 1:
            assert groups.dp is groups.dp_cp
        for kind in GROUP_KINDS:
            group = getattr(groups, kind)
            expected = dims.group_of(kind, rank)
            assert dist.get_process_group_ranks(group) == expected, (kind, rank, dims)
            total = torch.tensor([float(rank)])
            dist.all_reduce(total, group=group)  # the group really connects exactly those ranks
            assert total.item() == float(sum(expected)), (kind, rank)
            checked += 1
        assert groups.coords == dims.coords(rank)
        checked += _check_mesh(dims, rank, groups)
    return checked


def _check_mesh(dims: ParallelDims, rank: int, groups) -> int:
    """The mesh's view of each kind has the members of that kind's group, and this rank's index in it is its
    coordinate there; one all-reduce over the flattened views proves they connect those ranks."""
    mesh = build_mesh(dims, "cpu")
    coords = dims.coords(rank)
    for kind in GROUP_KINDS:
        view = mesh[kind]
        members = dist.get_process_group_ranks(view.get_group())
        assert members == dist.get_process_group_ranks(getattr(groups, kind)), (kind, rank, dims, members)
        assert view.mesh.tolist() == members, (kind, rank, view)
        block = coords.dp * dims.cp + coords.cp
        by_kind = {"dp_cp": block, "dp_cp_tp": block * dims.tp + coords.tp}
        expected = by_kind.get(kind) if kind.startswith("dp_") else None
        expected = getattr(coords, kind) if expected is None else expected
        assert view.get_local_rank() == expected, (kind, rank, dims)
    for kind in ("dp_cp", "dp_cp_tp", "ep", "edp"):  # the views the sharding and the token counts use
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
    build_groups(ParallelDims.from_world_size(4, ep=2), rank)


def test_groups_refuse_dims_of_another_world():
    import pytest

    with pytest.raises(RuntimeError, match=r"world_size=2 but the dims were built for world_size=4"):
        run_distributed(_worker_wrong_world, 2)
