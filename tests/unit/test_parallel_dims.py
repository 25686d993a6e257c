"""ParallelDims: dp inference, validation, and the rank layout, without a process group."""

from __future__ import annotations

import itertools

import pytest

from lightning_moe_overlap.parallel import ParallelDims, ParallelDimsError
from lightning_moe_overlap.parallel.dims import GROUP_KINDS

SHAPES = [  # (world, tp, pp, cp, ep)
    (1, 1, 1, 1, 1),
    (2, 1, 1, 1, 2),
    (3, 1, 1, 1, 3),
    (4, 2, 1, 1, 2),
    (6, 1, 2, 1, 3),
    (8, 1, 1, 1, 8),
    (8, 2, 1, 2, 2),
    (8, 1, 2, 1, 4),
    (8, 2, 2, 1, 2),
    (16, 2, 2, 2, 4),
]


@pytest.mark.parametrize("world,tp,pp,cp,ep", SHAPES)
def test_dims_groups_partition_world_and_vary_one_dimension(world, tp, pp, cp, ep):
    dims = ParallelDims.from_world_size(world, tp=tp, pp=pp, cp=cp, ep=ep)
    assert dims.dp * dims.tp * dims.pp * dims.cp == world
    assert dims.ep * dims.edp == dims.dp * dims.cp * dims.tp
    expected_size = {"dp": dims.dp, "cp": cp, "dp_cp": dims.dp * cp, "tp": tp, "cp_tp": cp * tp, "dp_cp_tp": dims.dp * cp * tp, "pp": pp, "ep": ep, "edp": dims.edp}
    for kind in GROUP_KINDS:
        groups = dims.group_ranks(kind)
        assert sorted(r for g in groups for r in g) == list(range(world)), kind
        assert all(len(g) == expected_size[kind] for g in groups), kind
    # Oracle: two ranks share a group of a kind iff they agree on every coordinate outside that kind's axes.
    fixed = {
        "dp": ("pp", "cp", "tp"), "cp": ("pp", "dp", "tp"), "dp_cp": ("pp", "tp"), "tp": ("pp", "dp", "cp"), "cp_tp": ("pp", "dp"), "dp_cp_tp": ("pp",),
        "pp": ("dp", "cp", "tp"), "ep": ("pp", "edp"), "edp": ("pp", "ep"),
    }
    for a, b in itertools.combinations(range(world), 2):
        ca, cb = dims.coords(a), dims.coords(b)
        for kind in GROUP_KINDS:
            same = all(getattr(ca, f) == getattr(cb, f) for f in fixed[kind])
            assert (b in dims.group_of(kind, a)) == same, (kind, a, b)


def test_dims_rank_layout_by_hand():
    # 8 ranks, tp=2, ep=2: tp pairs are neighbours, and ep folds over them (experts are not tensor-sharded).
    dims = ParallelDims.from_world_size(8, tp=2, ep=2)
    assert dims.dp == 4 and dims.edp == 4
    assert dims.group_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.group_ranks("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert dims.group_ranks("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.group_ranks("edp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # tp=2, ep=4: an ep group spans two dp ranks' tp pairs.
    dims = ParallelDims.from_world_size(8, tp=2, ep=4)
    assert dims.group_ranks("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]] and dims.group_ranks("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # pp outermost: stage 0 is ranks 0..3 when pp=2, ep=4 on 8 ranks (dp=4).
    dims = ParallelDims.from_world_size(8, pp=2, ep=2)
    assert dims.group_ranks("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.group_ranks("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.coords(5).pp == 1 and dims.coords(5).dp == 1


def test_dims_world_not_multiple_lists_divisors():
    rule = r"world_size=6 .* is not a multiple of pp\*cp\*tp=4.*\[1, 2, 3, 6\]"
    with pytest.raises(ParallelDimsError, match=rule) as err:
        ParallelDims.from_world_size(6, tp=2, pp=2)
    assert err.value.rule == "world-size" and isinstance(err.value, ValueError)


def test_dims_ep_must_divide_dp_cp_tp_lists_valid_ep():
    rule = r"ep=3 does not divide dp\*cp\*tp=4.*Valid ep values here: \[1, 2, 4\]"
    with pytest.raises(ParallelDimsError, match=rule) as err:
        ParallelDims.from_world_size(4, ep=3)
    assert err.value.rule == "ep-divides-dp-cp"


@pytest.mark.parametrize("field,value", [("tp", 0), ("ep", -1), ("pp", 1.5), ("cp", True)])
def test_dims_rejects_non_positive_sizes(field, value):
    with pytest.raises(ValueError, match=rf"`{field}={value!r}` must be a positive integer"):
        ParallelDims.from_world_size(4, **{field: value})


def test_dims_rejects_bad_vpp_and_rank_and_kind():
    with pytest.raises(ValueError, match=r"`vpp=0` must be None or a positive integer"):
        ParallelDims.from_world_size(4, vpp=0)
    dims = ParallelDims.from_world_size(4)
    with pytest.raises(ValueError, match=r"rank=4 is outside \[0, world_size=4\)"):
        dims.coords(4)
    with pytest.raises(ValueError, match=r"unknown kind='xp'"):
        dims.group_ranks("xp")  # type: ignore[arg-type]
