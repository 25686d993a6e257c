"""The ep groups get NCCL's high-priority stream; every other group, and every group on gloo, gets no options."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from lightning_moe_overlap.parallel import ParallelDims, build_groups
from lightning_moe_overlap.parallel.dims import GROUP_KINDS
from lightning_moe_overlap.parallel.groups import group_options


class _FakeNCCL:
    """Stands in for ``ProcessGroupNCCL`` (absent from CPU builds of torch)."""

    class Options:
        def __init__(self) -> None:
            self.is_high_priority_stream = False


@pytest.fixture
def new_group_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Pretend an initialised 4-rank world; record every ``new_group`` call instead of creating a group."""
    calls: list[dict[str, Any]] = []

    def new_group(ranks: list[int], **kwargs: Any) -> tuple[int, ...]:
        calls.append({"ranks": list(ranks), **kwargs})
        return tuple(ranks)

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", _FakeNCCL, raising=False)
    return calls


def _ep_groups(dims: ParallelDims) -> list[list[int]]:
    return [list(ranks) for ranks in dims.group_ranks("ep")]


@pytest.mark.parametrize("explicit", [True, False], ids=["backend-argument", "default-group-backend"])
def test_nccl_ep_group_has_a_high_priority_stream(
    new_group_calls: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, explicit: bool
) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    dims = ParallelDims.from_world_size(4, ep=2)
    build_groups(dims, 0, backend="nccl" if explicit else None)
    ep = _ep_groups(dims)
    with_options = [c for c in new_group_calls if c.get("pg_options") is not None]
    assert [c["ranks"] for c in with_options] == ep
    assert all(isinstance(c["pg_options"], _FakeNCCL.Options) for c in with_options)
    assert all(c["pg_options"].is_high_priority_stream for c in with_options)
    # One single-rank group for cp/tp/pp, dp shared by dp_cp, ep with its options, edp: 1 + 1 + 2 + 2.
    assert len(new_group_calls) == 6


def test_gloo_groups_get_no_options(new_group_calls: list[dict[str, Any]]) -> None:
    build_groups(ParallelDims.from_world_size(4, ep=2), 0, backend="gloo")
    assert new_group_calls and all(c.get("pg_options") is None for c in new_group_calls)


@pytest.mark.parametrize("kind", [k for k in GROUP_KINDS if k != "ep"])
def test_only_the_ep_kind_has_options(kind: str) -> None:
    assert group_options(kind, "nccl") is None


# (world, tp, pp, cp, ep) -> new_group calls on rank 0: one single-rank group shared by every size-1 kind, one call
# per group of every distinct partition, ep always its own.
LAYOUTS = {
    (2, 1, 1, 1, 2): 3,  # dp == dp_cp == ep as ranks, but ep keeps its own: solo, dp, ep
    (4, 1, 1, 1, 2): 6,  # solo, dp (= dp_cp), ep x2, edp x2
    (4, 1, 1, 1, 1): 2,  # solo (cp, tp, pp, ep), dp (= dp_cp = edp)
    (4, 1, 1, 1, 4): 3,  # solo (cp, tp, pp, edp), dp (= dp_cp), ep
    (4, 1, 1, 2, 2): 8,  # dp x2 (= edp), cp x2, dp_cp, ep x2 (own, though = cp as ranks), solo (tp, pp)
}


def _recording(monkeypatch: pytest.MonkeyPatch, world: int) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []

    def new_group(ranks: list[int], **kwargs: Any) -> tuple[int, ...]:
        calls.append({"ranks": list(ranks), **kwargs})
        return (len(calls), *ranks)  # a distinct object per call

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "new_group", new_group)
    return calls


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_build_groups_builds_only_what_is_used(monkeypatch: pytest.MonkeyPatch, layout: tuple[int, ...]) -> None:
    world, tp, pp, cp, ep = layout
    dims = ParallelDims.from_world_size(world, tp=tp, pp=pp, cp=cp, ep=ep)
    calls = _recording(monkeypatch, world)
    groups = build_groups(dims, 0)
    assert len(calls) == LAYOUTS[layout]
    solo = [c for c in calls if c.get("use_local_synchronization")]
    assert [c["ranks"] for c in solo] == [[0]]  # every layout here has a size-1 kind
    for kind in GROUP_KINDS:  # every kind holds this rank's ranks (the fake group is (call, *ranks))
        assert list(getattr(groups, kind)[1:]) == dims.group_of(kind, 0), kind
    by_members: dict[tuple[int, ...], set[str]] = {}
    for kind in GROUP_KINDS:
        if kind != "ep":
            by_members.setdefault(tuple(dims.group_of(kind, 0)), set()).add(kind)
    for kinds in by_members.values():  # kinds alike in membership (ep aside) are one object
        assert len({id(getattr(groups, k)) for k in kinds}) == 1, kinds
    if ep > 1:
        assert all(groups.ep is not getattr(groups, k) for k in GROUP_KINDS if k != "ep")
