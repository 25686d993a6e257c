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
    with_options = [c for c in new_group_calls if c["pg_options"] is not None]
    assert [c["ranks"] for c in with_options] == ep
    assert all(isinstance(c["pg_options"], _FakeNCCL.Options) for c in with_options)
    assert all(c["pg_options"].is_high_priority_stream for c in with_options)
    assert len(new_group_calls) == sum(len(dims.group_ranks(kind)) for kind in GROUP_KINDS)


def test_gloo_groups_get_no_options(new_group_calls: list[dict[str, Any]]) -> None:
    build_groups(ParallelDims.from_world_size(4, ep=2), 0, backend="gloo")
    assert new_group_calls and all(c["pg_options"] is None for c in new_group_calls)


@pytest.mark.parametrize("kind", [k for k in GROUP_KINDS if k != "ep"])
def test_only_the_ep_kind_has_options(kind: str) -> None:
    assert group_options(kind, "nccl") is None
