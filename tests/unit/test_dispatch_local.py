"""Dispatchers on one process (ep=1): the stage contract, hand-over counts, per-call handles, factory errors, and
the all-to-all dispatcher's deduplicated path against its plain one."""

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
    all_to_all_many,
    exchange_counts,
    gather_sizes,
    reduce_scatter,
)
from lightning_moe_overlap.moe.dispatch.dedup import destinations, local_choices
from lightning_moe_overlap.moe.dispatch.alltoall import DedupHandle
from lightning_moe_overlap.moe.grouped import RowSplits, grouped_mlp
from lightning_moe_overlap.moe.dispatch.loopback import Loopback
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


def _plain_alltoall(group, num_experts, runtime):  # type: ignore[no-untyped-def]
    return AllToAllDispatcher(group, num_experts, runtime, dedup=False)


@pytest.mark.parametrize("cls", [AllToAllDispatcher, _plain_alltoall, AllGatherDispatcher])
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
    x_RD, splits, handle = dispatcher.dispatch(x, idx, w)
    assert isinstance(splits, RowSplits)  # one return type from every dispatcher, on every device
    assert x_RD.shape[0] == sum(splits.host_sizes()) == int(((idx >= 0) & (idx < E)).sum())
    y = dispatcher.combine(grouped_mlp(x_RD, splits, experts.gate_up_proj, experts.down_proj, experts.act_fn), handle)
    torch.testing.assert_close(y, experts(x, idx, w), atol=1e-12, rtol=1e-12)
    assert dataclasses.is_dataclass(handle) and type(handle).__dataclass_params__.frozen  # type: ignore[attr-defined]
    with pytest.raises(dataclasses.FrozenInstanceError):
        handle.num_tokens = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("cls", "forward", "backward"), [(AllToAllDispatcher, 3, 2), (_plain_alltoall, 3, 2), (AllGatherDispatcher, 5, 3)]
)
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


@pytest.mark.parametrize(
    ("top_k", "weights_dtype"), [(1, torch.float32), (2, torch.float32), (4, torch.float32), (2, torch.bfloat16)]
)
@pytest.mark.parametrize("routing", ["random", "one_expert", "all_dropped"])
def test_dedup_is_bitwise_the_plain_path_on_one_rank(top_k: int, weights_dtype: torch.dtype, routing: str) -> None:
    """ep=1: every choice of a token on one rank, so the sums run in the same order: bitwise equal, all k (k=1
    runs the plain path: nothing to deduplicate).

    bfloat16 weights travel apart from their int32 expert indices (float32 ones carry the indices as floats).
    """
    torch.manual_seed(0)
    experts = Experts(E, D, 6, impl="loop", dtype=torch.float32)
    idx, w = _routing(7, top_k, seed=top_k)
    if routing == "one_expert":
        idx[:, 0] = 2  # expert 2 for every token (others get fewer, some none)
        idx[:, 1:] = (2 + torch.arange(1, top_k)) % E
    elif routing == "all_dropped":
        idx[:] = E
    results = []
    for dedup in (False, True):
        x = torch.randn(7, D, generator=torch.Generator().manual_seed(1)).requires_grad_()
        w_in = w.to(weights_dtype).requires_grad_()
        runtime = CountingRuntime(communicator=Loopback(0.0))  # rows leave the process (simulated ep): dedup runs
        dispatcher = AllToAllDispatcher(None, E, runtime, dedup=dedup)
        x_RD, splits, handle = dispatcher.dispatch(x, idx, w_in)
        assert isinstance(handle, DedupHandle) is (dedup and top_k > 1)
        y = grouped_mlp(x_RD, splits, experts.gate_up_proj, experts.down_proj, experts.act_fn)
        out = dispatcher.combine(y, handle)
        grads = torch.autograd.grad(out.square().sum(), [x, w_in, experts.gate_up_proj, experts.down_proj])
        assert runtime.handoffs == 3 + 2  # counts, tokens, combine; backward: combine, tokens (either path)
        results.append((out, x_RD, torch.tensor(splits.host_sizes()), *grads))
    for i, (plain, dedup) in enumerate(zip(*results)):
        assert torch.equal(plain, dedup), i
    if routing == "all_dropped":
        assert not results[1][0].any()


def test_dedup_rows_and_local_choices() -> None:
    """One row per (destination, token); choices for other ranks or dropped get the marker ``local_experts``."""
    indices_TK = torch.tensor([[0, 1], [3, 0], [2, 3], [4, -1]])  # E=4, ep=2: experts 0-1 on rank 0, 2-3 on rank 1
    dest_TK, order_GT, rows_G = destinations(indices_TK, num_local=2, ep_size=2)
    assert dest_TK.tolist() == [[0, 0], [1, 0], [1, 1], [2, 2]]
    assert rows_G.tolist() == [2, 2]  # rank 0: tokens 0, 1; rank 1: tokens 1, 2 (token 3 is dropped entirely)
    row_U = order_GT[:4]
    assert row_U.tolist() == [0, 1, 5, 6]  # g * T + t, destination-major
    token_U, dest_U = row_U % 4, row_U // 4
    local_UK = local_choices(indices_TK, dest_TK, token_U, dest_U, num_local=2)
    assert local_UK.dtype == torch.int32
    assert local_UK.tolist() == [[0, 1], [2, 0], [1, 2], [0, 1]]


def test_alltoall_dedup_knob() -> None:
    assert AllToAllDispatcher(None, E, None).dedup is False
    idx, w = _routing(3, 2, seed=0)
    _, _, handle = AllToAllDispatcher(None, E, None).dispatch(torch.randn(3, D), idx, w)
    assert not isinstance(handle, DedupHandle)  # one rank, no loopback: nothing leaves the process
    assert build_dispatcher("alltoall", None, E, None, dedup=False).dedup is False
    assert "dedup=False" in repr(build_dispatcher("alltoall", None, E, None, dedup=False))
    assert isinstance(build_dispatcher("allgather", None, E, None, dedup=False), AllGatherDispatcher)  # ignored
    with pytest.raises(TypeError, match=r"dedup='yes' is a str, not a bool.*Pass dedup=True or dedup=False \(default\)"):
        AllToAllDispatcher(None, E, None, dedup="yes")  # type: ignore[arg-type]


def test_all_to_all_many_one_hand_over_and_integer_metadata() -> None:
    """Several tensors at one comm point; floating ones get gradients back (one more), integers none."""
    runtime = CountingRuntime()
    x = torch.randn(3, 2, requires_grad=True)
    w = torch.rand(3, 1, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[1], [0], [2]], dtype=torch.int32)
    x_out, w_out, ids_out = all_to_all_many((x, w, ids), [3], [3], None, runtime)
    assert runtime.handoffs == 1 and torch.equal(ids_out, ids) and not ids_out.requires_grad
    (x_out.sum() * 2).backward()  # w_out unused: its gradient is sent as zeros, in the same exchange
    assert runtime.handoffs == 2
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
    assert torch.equal(w.grad, torch.zeros_like(w))


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
    assert DISPATCHER_KNOBS["flex"] == FlexDispatcher.knobs and DISPATCHER_KNOBS["alltoall"] == ("dedup", "static")


@pytest.mark.parametrize("dedup", [False, True])
def test_the_strategy_setting_reaches_the_alltoall_dispatcher(dedup: bool) -> None:
    from types import SimpleNamespace

    from lightning_moe_overlap.config import OverlapConfig
    from lightning_moe_overlap.moe.ep import ExpertParallelExperts
    from lightning_moe_overlap.moe.layer import MoELayer
    from lightning_moe_overlap.overlap.runtime import CommRuntime
    from lightning_moe_overlap.moe.model_handle import MoEModelHandle

    model = torch.nn.Sequential(MoELayer(hidden_size=8, ffn_hidden_size=4, num_experts=E, top_k=2))
    handle = MoEModelHandle(model)
    handle.apply(OverlapConfig(alltoall_dedup=dedup), SimpleNamespace(ep=None), CommRuntime())
    (experts,) = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
    assert isinstance(experts.dispatcher, AllToAllDispatcher) and experts.dispatcher.dedup is dedup
