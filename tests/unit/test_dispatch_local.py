"""Dispatchers on one process (ep=1): the stage contract, hand-over counts, per-call handles, factory errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_moe_overlap.config import DISPATCHERS
from lightning_moe_overlap.moe import Experts
from lightning_moe_overlap.moe.dispatch import (
    DISPATCHER_CLASSES,
    DISPATCHER_KNOBS,
    AllGatherDispatcher,
    AllToAllDispatcher,
    FlexDispatcher,
    build_dispatcher,
    check_expert_split,
)
from lightning_moe_overlap.moe.dispatch.comm import (
    all_gather,
    all_to_all,
    exchange_counts,
    gather_sizes,
    reduce_scatter,
)
from lightning_moe_overlap.moe.grouped import grouped_mlp
from lightning_moe_overlap.moe.permute import chunk_permutation, inverse_permutation, sort_by_expert
from tests.unit.test_dispatch_flex import CountingRuntime

E, D = 4, 8


def _routing(T: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = (
        torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        if T
        else torch.zeros(0, K, dtype=torch.long)
    )
    return idx, torch.rand(T, K, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("cls", [AllToAllDispatcher, AllGatherDispatcher])
@pytest.mark.parametrize("num_tokens", [0, 1, 9])
def test_dispatch_combine_equals_unsharded_experts(cls: type, num_tokens: int) -> None:
    torch.manual_seed(0)
    experts = Experts(E, D, 6, impl="loop", dtype=torch.float64)
    x = torch.randn(num_tokens, D, dtype=torch.float64, requires_grad=True)
    idx, w = _routing(num_tokens, 2, seed=num_tokens)
    if num_tokens:
        idx[0, 1] = -1  # dropped (DeepEP marker) and
        idx[-1, 0] = E  # dropped (HF marker) choices are ignored
    dispatcher = cls(None, E, None)
    x_RD, counts, handle = dispatcher.dispatch(x, idx, w)
    assert x_RD.shape[0] == sum(counts) == int(((idx >= 0) & (idx < E)).sum())
    y = dispatcher.combine(grouped_mlp(x_RD, counts, experts.gate_up_proj, experts.down_proj, experts.act_fn), handle)
    torch.testing.assert_close(y, experts(x, idx, w), atol=1e-12, rtol=1e-12)
    assert dataclasses.is_dataclass(handle) and type(handle).__dataclass_params__.frozen  # type: ignore[attr-defined]
    with pytest.raises(dataclasses.FrozenInstanceError):
        handle.num_tokens = 3  # type: ignore[misc]


@pytest.mark.parametrize(("cls", "forward", "backward"), [(AllToAllDispatcher, 3, 2), (AllGatherDispatcher, 5, 3)])
def test_single_rank_still_hands_over_at_every_comm_point(cls: type, forward: int, backward: int) -> None:
    """ep=1 issues no communication but keeps the hand-over sequence of ep>1 (counted in the distributed tests)."""
    runtime = CountingRuntime()
    dispatcher = cls(None, E, runtime)
    x = torch.randn(5, D, dtype=torch.float64, requires_grad=True)
    idx, w = _routing(5, 2, seed=0)
    x_RD, _, handle = dispatcher.dispatch(x, idx, w.requires_grad_())
    out = dispatcher.combine(x_RD * 2.0, handle)
    assert runtime.handoffs == forward
    out.sum().backward()
    assert runtime.handoffs == forward + backward


def test_two_calls_in_flight_on_one_dispatcher() -> None:
    """State lives in the handles: interleaved dispatches combine correctly in any order."""
    for dispatcher in (AllToAllDispatcher(None, E, None), AllGatherDispatcher(None, E, None)):
        xa, xb = torch.randn(6, D, dtype=torch.float64), torch.randn(2, D, dtype=torch.float64)
        (ia, wa), (ib, wb) = _routing(6, 2, seed=1), _routing(2, 1, seed=2)
        ra, _, ha = dispatcher.dispatch(xa, ia, wa)
        rb, _, hb = dispatcher.dispatch(xb, ib, wb)
        torch.testing.assert_close(dispatcher.combine(rb, hb), xb * wb.sum(1, keepdim=True))
        torch.testing.assert_close(dispatcher.combine(ra, ha), xa * wa.sum(1, keepdim=True))


def test_comm_ops_short_circuit_with_one_hand_over_each() -> None:
    runtime = CountingRuntime()
    x = torch.randn(3, 2, requires_grad=True)
    y = all_to_all(x, [3], [3], None, runtime)
    y = all_gather(y, None, runtime)
    y = reduce_scatter(y, None, runtime)
    assert runtime.handoffs == 3
    y.sum().backward()
    assert runtime.handoffs == 6
    torch.testing.assert_close(x.grad, torch.ones_like(x))
    assert exchange_counts(torch.tensor([[1, 2]]), None, runtime).tolist() == [[1, 2]]
    assert gather_sizes(4, None, runtime, torch.device("cpu")) == [4]
    assert runtime.handoffs == 8


def test_permutation_helpers() -> None:
    order, counts = sort_by_expert(torch.tensor([[2, 0], [0, 5], [-1, 2]]), 3)
    assert counts.tolist() == [2, 0, 2]
    assert order[:4].tolist() == [1, 2, 0, 5]  # expert 0: (t0,k1), (t1,k0); expert 2: (t0,k0), (t2,k1)
    perm = chunk_permutation(torch.tensor([[1, 0, 2], [3, 1, 0]]), 7)
    assert perm.tolist() == [0, 3, 4, 5, 6, 1, 2]
    assert perm[inverse_permutation(perm)].tolist() == list(range(7))


def test_build_dispatcher_names_and_knobs() -> None:
    assert isinstance(build_dispatcher("alltoall", None, E, None, deepep_num_sms=24), AllToAllDispatcher)
    assert isinstance(build_dispatcher("allgather", None, E, None), AllGatherDispatcher)
    with pytest.raises(ValueError, match=r"dispatcher='a2a' is not one of \['alltoall', 'allgather', 'flex'\]"):
        build_dispatcher("a2a", None, E, None)
    with pytest.raises(TypeError, match=r"unknown knob\(s\) \['num_sm'\]"):
        build_dispatcher("alltoall", None, E, None, num_sm=20)


def test_expert_split_rule() -> None:
    check_expert_split(8, 4, owner="x")
    with pytest.raises(ValueError, match=r"num_experts=6 is not divisible by ep=4.*Choose ep among \[1, 2, 3, 6\]"):
        check_expert_split(6, 4, owner="x")
    with pytest.raises(ValueError, match="`build_dispatcher`: num_experts=0 must be a positive integer"):
        build_dispatcher("alltoall", None, 0, None)
    with pytest.raises(RuntimeError, match=r"`AllToAllDispatcher`: num_experts=0 cannot split over ep=1"):
        AllToAllDispatcher(None, 0, None)  # internal: the boundary above checked it


def test_dispatcher_names_have_one_spelling() -> None:
    assert tuple(DISPATCHER_CLASSES) == DISPATCHERS
    assert DISPATCHER_KNOBS["flex"] == FlexDispatcher.knobs and DISPATCHER_KNOBS["alltoall"] == ()
