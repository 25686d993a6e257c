"""The static all-to-all layout on one process: its slots, its drop rule and its errors.

Oracles: the plain dispatch (no slots) for the results, and counts written out by hand for the slot plan.
"""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_moe_overlap.moe import MoELayer, apply_expert_parallel
from lightning_moe_overlap.moe.dispatch import build_dispatcher
from lightning_moe_overlap.moe.dispatch.alltoall import AllToAllDispatcher
from lightning_moe_overlap.moe.dispatch.static_slots import SlotGrid, expert_major, plan_slots, slot_capacity
from lightning_moe_overlap.moe.grouped import RowSplits
from lightning_moe_overlap.moe.placement import ExpertPlacement
from tests.helpers.syncs import SyncCounter


def test_slot_capacity_is_the_experts_capacity_or_every_token() -> None:
    assert slot_capacity(10, 2, 8, None) == 10  # dropless: no expert gets more than T rows from one rank
    assert slot_capacity(10, 2, 8, 1.0) == 3  # ceil(10 * 2 / 8)
    assert slot_capacity(10, 2, 8, 100.0) == 10  # never more than T
    assert slot_capacity(0, 2, 8, 1.0) == 0


def test_plan_puts_each_row_in_its_experts_slots_in_token_order() -> None:
    indices = torch.tensor([[1, 0], [1, 2], [1, 4], [4, 1]])  # expert 1 four times, 4 (dropped: E=4) twice
    plan = plan_slots(indices, num_experts=4, capacity=3)
    # Sorted by expert: (0: a1) (1: a0 a2 a4 a7) (2: a3) then the dropped a5 a6.
    assert plan.order_A.tolist() == [1, 0, 2, 4, 7, 3, 5, 6]
    assert plan.slot_A.tolist() == [0, 3, 4, 5, 12, 6, 12, 12]  # expert 1's fourth row is over capacity
    assert plan.kept_A.tolist() == [True, True, True, True, False, True, False, False]
    assert plan.sent_E.tolist() == [1, 3, 1, 0] and plan.over_E.tolist() == [0, 1, 0, 0]


def test_expert_major_takes_full_slots_by_expert_then_source_then_the_empty_ones() -> None:
    recv = torch.tensor([[1, 2], [2, 0]])  # [source][local expert], capacity 2: slots s*4 + e*2 + p
    assert expert_major(recv, SlotGrid.build(2, 2, 2, recv.device)).tolist() == [0, 4, 5, 2, 3, 1, 6, 7]


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_static_matches_the_plain_dispatch_bitwise_without_a_host_read(capacity_factor: float | None) -> None:
    torch.manual_seed(0)
    base = MoELayer(16, 8, 4, 2, capacity_factor=capacity_factor)
    plain, static = copy.deepcopy(base), copy.deepcopy(base)
    apply_expert_parallel(plain, None, dispatcher="alltoall")
    apply_expert_parallel(static, None, dispatcher="alltoall", static=True)
    x = torch.randn(2, 9, 16)
    xp, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    plain(xp).square().sum().backward()
    with SyncCounter() as counter:
        out = static(xs)
        out.square().sum().backward()
    assert counter.counts == {}
    assert torch.equal(out, plain(x.clone())) and torch.equal(xs.grad, xp.grad)
    for (name, p), q in zip(plain.named_parameters(), static.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_slots_smaller_than_the_load_drop_by_position_and_count_it() -> None:
    """A slot factor below what the experts keep drops the latest rows of each expert (the ``position`` policy)."""
    torch.manual_seed(1)
    base = MoELayer(16, 8, 4, 2)
    oracle = MoELayer(16, 8, 4, 2, capacity_factor=0.5, token_drop_policy="position")
    oracle.load_state_dict(base.state_dict())
    static = copy.deepcopy(base)
    (module,) = apply_expert_parallel(static, None, dispatcher="alltoall", static=True)
    module.dispatcher.slot_capacity_factor = 0.5
    x = torch.randn(12, 16)
    assert torch.equal(static(x), oracle(x))
    usage = module.dispatcher.static_usage()
    assert usage.calls == 1 and usage.slots == 4 * 3 and usage.rows + usage.dropped == 12 * 2 and usage.dropped > 0
    assert usage.padding_share == 1 - usage.rows / 12 and module.dispatcher.static_usage().calls == 0  # then reset


def test_static_dispatch_errors_name_the_rule() -> None:
    with pytest.raises(TypeError, match="static='yes' is a str"):
        AllToAllDispatcher(None, 4, None, static="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dedup=True and static=True.*Pick one"):
        build_dispatcher("alltoall", None, 4, None, dedup=True, static=True)
    dispatcher = build_dispatcher("alltoall", None, 4, None, static=True)
    x, idx, w = torch.randn(3, 8), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2)
    with pytest.raises(NotImplementedError, match="cannot travel in FP8.*static=False"):
        dispatcher.dispatch(x, idx, w, fp8=object())  # type: ignore[arg-type]
    layer = MoELayer(16, 8, 4, 2)
    (module,) = apply_expert_parallel(layer, None, dispatcher="alltoall", static=True)
    with pytest.raises(NotImplementedError, match="static all-to-all layout.*alltoall_static=False"):
        module.set_placement(ExpertPlacement((0, 1, 2, 3), 1, replicas=(0,)))
    with pytest.raises(NotImplementedError, match="expert_backend='te' with a static.*static=False"):
        apply_expert_parallel(MoELayer(16, 8, 4, 2), None, dispatcher="alltoall", static=True, expert_backend="te")


def test_padded_rows_get_no_expert_bias() -> None:
    bias = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    rows = RowSplits.padded(torch.tensor([2, 1])).bias_rows(bias, num_rows=5)
    assert rows.tolist() == [[1.0, 2.0], [1.0, 2.0], [3.0, 4.0], [0.0, 0.0], [0.0, 0.0]]
