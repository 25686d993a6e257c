"""Placements (``moe/placement.py``) and ``ExpertBalance``'s rules, in one process.

Oracles: hand-worked maps and loads; for the balanced placement, every placement of small cases enumerated (the
best most-loaded rank there is) and the greedy packing's bound, max <= 4/3 of the best (Graham's LPT bound), with
the tolerance the fewer-moves choice may add.
"""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
import torch

from lightning_moe_overlap import ExpertBalance, MoEOverlapStrategy
from lightning_moe_overlap.moe.expert_moves import LayerMove, move_rows
from lightning_moe_overlap.moe.placement import (
    FEWER_MOVES_TOLERANCE,
    ExpertPlacement,
    balanced_placement,
    balanced_within_nodes,
)


def test_identity_maps_every_expert_to_its_own_slot_and_ranks_by_block():
    placement = ExpertPlacement.identity(8, 4)
    assert placement.is_identity and placement.slots_per_rank == 2
    assert placement.slot_of() == list(range(8))
    assert [placement.rank_of(e) for e in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_a_permutation_routes_choices_to_slots_and_keeps_dropped_ones():
    placement = ExpertPlacement((2, 0, 3, 1), ep=2)  # slot 0 holds expert 2, slot 1 expert 0, ...
    assert placement.slot_of() == [1, 3, 0, 2]
    indices = torch.tensor([[0, 1], [2, 3], [4, -1]])  # 4 (= E) and -1 mark dropped choices
    slots = ExpertPlacement.to_slots(indices, placement.slot_table(torch.device("cpu")))
    assert slots.tolist() == [[1, 3], [0, 2], [4, -1]]
    assert slots.dtype == indices.dtype


def test_rank_loads_imbalance_and_moved_experts_follow_the_map():
    placement = ExpertPlacement((2, 0, 3, 1), ep=2)  # rank 0: experts 2, 0; rank 1: experts 3, 1
    counts = [10.0, 1.0, 5.0, 4.0]
    assert placement.rank_loads(counts) == [15.0, 5.0]
    assert placement.imbalance(counts) == 1.5
    assert ExpertPlacement.identity(4, 2).imbalance([0.0] * 4) == 0.0
    assert placement.moved_experts(ExpertPlacement((0, 2, 1, 3), ep=2)) == []  # only slots within a rank change
    assert placement.moved_experts(ExpertPlacement.identity(4, 2)) == [1, 2]  # 1 comes to rank 0, 2 leaves it


@pytest.mark.parametrize(
    "experts,ep,replicas,match",
    [((0, 1, 2), 2, (), r"3 slots and 0 replicas over ep=2; every ep rank holds the same number"),
     ((0, 1, 2, 3), 2, (1,), r"4 slots and 1 replicas over ep=2; every ep rank holds the same number"),
     ((0, 0, 1, 2), 2, (), "not a permutation"),
     ((0, 1, 2, 3), 2, (0, 4), r"replicas=\[0, 4\] names experts outside 0..3")],
)  # fmt: skip
def test_a_placement_that_cannot_be_is_refused(experts, ep, replicas, match):
    with pytest.raises(ValueError, match=match):
        ExpertPlacement(experts, ep, replicas)


def test_replicas_take_dispatch_slots_after_each_ranks_primaries_and_share_the_load():
    placement = ExpertPlacement((0, 1, 2, 3), ep=2, replicas=(0, 3))  # rank 0: 0 1 + copy of 0; rank 1: 2 3 + 3
    assert placement.copies() == [2, 1, 1, 2] and not placement.is_identity
    assert [placement.dispatch_slot(0, c) for c in range(2)] == [0, 2]
    assert [placement.dispatch_slot(3, c) for c in range(2)] == [4, 5]
    assert placement.rank_loads([10.0, 2.0, 4.0, 6.0]) == [12.0, 10.0]  # 5 + 2 + 5 | 4 + 3 + 3
    copies_EC, num_E = placement.copy_table(torch.device("cpu"))
    assert copies_EC.tolist() == [[0, 2], [1, 1], [3, 3], [4, 5]] and num_E.tolist() == [2, 1, 1, 2]


def test_a_replicated_experts_choices_alternate_over_its_copies_in_token_order():
    placement = ExpertPlacement((0, 1, 2, 3), ep=2, replicas=(0, 3))
    indices = torch.tensor([[0, 3], [0, 1], [4, 0], [3, 0], [2, 3]])  # 4 (= E): dropped
    slots = ExpertPlacement.to_copies(indices, *placement.copy_table(torch.device("cpu")), num_slots=6)
    # expert 0's choices in token order -> copies 0, 1, 0, 1; expert 3's -> 0, 1, 0; dropped -> E + R
    assert slots.tolist() == [[0, 4], [2, 1], [6, 0], [5, 2], [3, 4]]


def test_balanced_replicas_go_to_the_hottest_experts_on_ranks_without_a_copy():
    counts = [90.0, 10.0, 10.0, 10.0, 10.0, 10.0, 10.0, 10.0]
    placed = balanced_placement(counts, ExpertPlacement.identity(8, 2), replicas=2)
    assert placed.copies()[0] == 3  # 90 / 2 = 45 per copy is still the most: it takes both replicas
    assert placed.rank_of(0) in (0, 1) and sorted(placed.replicas) == [0, 0]
    assert placed.imbalance(counts) < ExpertPlacement.identity(8, 2).imbalance(counts)
    with pytest.raises(ValueError, match=r"replicas=3 must be a non-negative multiple of ep=2"):
        balanced_placement(counts, ExpertPlacement.identity(8, 2), replicas=3)


def test_balanced_placement_spreads_hot_experts_and_moves_few():
    counts = [520.0, 519.0, 486.0, 523.0, 148.0, 155.0, 167.0, 188.0, 161.0, 183.0, 195.0, 186.0, 170.0, 176.0,
              160.0, 159.0]  # fmt: skip
    current = ExpertPlacement.identity(16, 4)  # the four hot experts all on rank 0: 2.0x the mean
    assert current.imbalance(counts) > 1.9
    placed = balanced_placement(counts, current)
    assert placed.imbalance(counts) < 1.01
    assert sorted(placed.rank_of(e) for e in range(4)) == [0, 1, 2, 3]  # one hot expert per rank
    moved = current.moved_experts(placed)
    assert len(moved) <= 8  # three hot experts out, three cold in, and what the fine balance adds
    slot_of = placed.slot_of()
    assert all(slot_of[e] == e for e in range(16) if e not in moved)  # those that stay keep their slots


def test_even_counts_move_nothing():
    current = ExpertPlacement((3, 1, 0, 2, 5, 4), ep=3)
    assert balanced_placement([7.0] * 6, current) == current


def _best_max(counts: list[float], ep: int) -> float:
    per_rank = len(counts) // ep
    return min(
        max(sum(counts[e] for e in order[r * per_rank : (r + 1) * per_rank]) for r in range(ep))
        for order in itertools.permutations(range(len(counts)))
    )


@pytest.mark.parametrize("seed", range(6))
def test_balanced_placement_is_within_the_greedy_packings_bound_of_the_best(seed):
    rng = random.Random(seed)
    num, ep = rng.choice([(6, 2), (6, 3), (8, 2), (8, 4)])
    counts = [float(rng.randint(0, 100)) for _ in range(num)]
    current = ExpertPlacement(tuple(rng.sample(range(num), num)), ep)
    placed = balanced_placement(counts, current)
    assert sorted(placed.experts) == list(range(num))
    best = _best_max(counts, ep)
    assert max(placed.rank_loads(counts)) <= (4 / 3) * (1 + FEWER_MOVES_TOLERANCE) * best + 1e-9


def test_within_nodes_every_expert_keeps_its_node_and_each_nodes_ranks_balance():
    counts = [40.0, 40.0, 5.0, 5.0, 10.0, 10.0, 10.0, 10.0]  # experts 0 and 1 hot, both on rank 0 (node 0)
    current, nodes = ExpertPlacement.identity(8, 4), [0, 0, 1, 1]  # ranks 0, 1 on node 0; ranks 2, 3 on node 1
    placed = balanced_within_nodes(counts, current, 4, nodes)
    node_of = [nodes[placed.rank_of(e)] for e in range(8)]
    assert node_of == [nodes[current.rank_of(e)] for e in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert placed.rank_of(0) != placed.rank_of(1)  # node 0's two hot experts on its two ranks
    assert {(nodes[j // placed.replicas_per_rank] == 0) == (e < 4) for j, e in enumerate(placed.replicas)} == {True}
    loads = placed.rank_loads(counts)
    assert loads[0] == loads[1] and loads[0] < current.rank_loads(counts)[0]
    everywhere = balanced_placement(counts, current, 4)  # across nodes the hot experts may leave node 0
    assert max(everywhere.rank_loads(counts)) <= max(loads)
    assert balanced_within_nodes(counts, current, 0, [0, 0, 0, 0]) == balanced_placement(counts, current)
    with pytest.raises(ValueError, match=r"node_of_rank has 2 entries for ep=4"):
        balanced_within_nodes(counts, current, 0, [0, 1])
    with pytest.raises(ValueError, match=r"replicas=2 must be a non-negative multiple of ep=4"):
        balanced_within_nodes(counts, current, 2, nodes)


def test_balanced_placement_needs_one_count_per_expert():
    with pytest.raises(ValueError, match=r"3 counts for a placement of 4 experts; pass one count per logical expert"):
        balanced_placement([1.0, 2.0, 3.0], ExpertPlacement.identity(4, 2))


@pytest.mark.parametrize(
    "kwargs,match",
    [({"every_n_steps": 0}, r"every_n_steps=0 must be a positive integer"),
     ({"min_gain": 1.0}, r"min_gain=1.0 must be a number in \[0, 1\)"),
     ({"min_gain": True}, r"min_gain=True must be a number"),
     ({"redundant_experts": -2}, r"redundant_experts=-2 must be a non-negative integer")],
)  # fmt: skip
def test_expert_balance_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ExpertBalance(**kwargs)


def _setup(strategy: object) -> None:
    ExpertBalance().setup(SimpleNamespace(strategy=strategy), None, "fit")  # type: ignore[arg-type]


def test_expert_balance_needs_this_strategy_with_ep_above_one_and_no_optimizer_offload():
    with pytest.raises(TypeError, match=r"the Trainer's strategy is SimpleNamespace; re-placing experts needs"):
        _setup(SimpleNamespace())
    with pytest.raises(ValueError, match=r"ep=1 holds every expert on every rank"):
        _setup(MoEOverlapStrategy(ep=1))
    with pytest.raises(NotImplementedError, match=r"optimizer_cpu_offload=True keeps host copies"):
        _setup(MoEOverlapStrategy(ep=2, optimizer_cpu_offload=True))
    _setup(MoEOverlapStrategy(ep=2))


def test_within_nodes_must_be_a_bool():
    with pytest.raises(TypeError, match=r"within_nodes=1 must be a bool: True keeps every expert on its node"):
        ExpertBalance(within_nodes=1)  # type: ignore[arg-type]


def test_a_second_expert_balance_is_refused():
    first, second = ExpertBalance(), ExpertBalance(every_n_steps=5)
    trainer = SimpleNamespace(strategy=MoEOverlapStrategy(ep=2), callbacks=[first, second])
    with pytest.raises(ValueError, match=r"the Trainer has 2 `ExpertBalance` callbacks; each would re-place"):
        second.setup(trainer, None, "fit")  # type: ignore[arg-type]


def test_replicas_are_refused_where_they_cannot_run():
    balance = ExpertBalance(redundant_experts=2)
    balance.setup(SimpleNamespace(strategy=MoEOverlapStrategy(ep=2)), None, "fit")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"redundant_experts=3 is not a multiple of ep=2; every ep rank holds"):
        ExpertBalance(redundant_experts=3).setup(SimpleNamespace(strategy=MoEOverlapStrategy(ep=2)), None, "fit")
    strategy = MoEOverlapStrategy(ep=2, shard="full", delay_wgrad=True)
    with pytest.raises(NotImplementedError, match=r"does not run with shard='full' .*, delay_wgrad=True"):
        balance.setup(SimpleNamespace(strategy=strategy), None, "fit")  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match=r"does not run with alltoall_static=True \(slots sized for E"):
        static = SimpleNamespace(strategy=MoEOverlapStrategy(ep=2, alltoall_static=True))
        balance.setup(static, None, "fit")  # type: ignore[arg-type]
    both = ExpertBalance(redundant_experts=3)
    with pytest.raises(ValueError, match=r"(?s)2 problems:\n  1\. .*not a multiple of ep=2.*\n  2\. .*shard='full'"):
        both.setup(SimpleNamespace(strategy=strategy), None, "fit")  # type: ignore[arg-type]


def test_hot_experts_copied_on_each_others_ranks_do_not_trade_primaries():
    """Recorded in a run (layer 1, step 7): the packing chose e0 <-> e1 primaries and e2 <-> e3, while both ranks
    hold copies of 0 and 1 before and after; only 2 and 3 need to move."""
    current = ExpertPlacement((0, 5, 4, 3, 6, 1, 2, 7), 2, replicas=(1, 0))
    swapped = ExpertPlacement((1, 5, 4, 2, 6, 0, 3, 7), 2, replicas=(0, 1))
    from lightning_moe_overlap.moe.placement import _roles_kept

    kept = _roles_kept(swapped, current)
    assert current.moved_experts(kept) == [2, 3]  # not 0 and 1
    counts = [40.0, 45.0, 9.0, 12.0, 10.0, 11.0, 8.0, 13.0]
    assert kept.rank_loads(counts) == swapped.rank_loads(counts)  # the same copies on every rank


def test_new_replicas_alone_are_preferred_to_moving_primaries_when_as_even():
    counts = [50.0, 50.0, 10.0, 10.0, 10.0, 10.0, 10.0, 10.0]  # two hot experts, one on each rank
    current = ExpertPlacement((0, 2, 3, 4, 1, 5, 6, 7), 2, replicas=(1, 0))  # each copied on the other rank: even
    for _ in range(3):  # as a run re-placing at every step would: no swap of the two hot primaries, ever
        placed = balanced_placement(counts, current, 2)
        assert placed.experts == current.experts and current.moved_experts(placed) == []
        assert placed.rank_loads(counts) == [80.0, 80.0]
        current = placed


def test_moving_rows_in_one_process_permutes_every_tensor_in_place():
    before, after = ExpertPlacement.identity(4, 1), ExpertPlacement((2, 0, 3, 1), 1)
    weight, moment = torch.arange(12.0).view(4, 3), torch.arange(4.0).view(4, 1) * 10
    held = weight
    report = move_rows([LayerMove([weight, moment], before, after)])
    assert weight is held and weight.tolist() == [[6.0, 7.0, 8.0], [0.0, 1.0, 2.0], [9.0, 10.0, 11.0], [3.0, 4.0, 5.0]]
    assert moment.view(-1).tolist() == [20.0, 0.0, 30.0, 10.0]  # slot s holds expert after.experts[s]
    assert (report.rows_sent, report.bytes_sent) == (0, 0)


def test_moving_rows_held_twice_is_refused(world_of_one, monkeypatch):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_moe_overlap._compat import torch as torch_compat

    tensor = distribute_tensor(torch.zeros(4, 2), init_device_mesh("cpu", (1,)), [Shard(0)])
    monkeypatch.setattr(torch_compat, "row_owners", lambda t: [(0, 0, 4), (0, 0, 4)])  # as a `Replicate` would
    move = LayerMove([tensor], ExpertPlacement.identity(4, 2), ExpertPlacement((1, 0, 2, 3), 2))
    with pytest.raises(NotImplementedError, match=r"held as 8 rows across its ranks, for 4 slots"):
        move_rows([move])


def test_an_experts_module_routes_by_its_placement_and_refuses_another_modules():
    """ep=1, one process: the slot table is applied (the module's rows re-placed by hand give the same output),
    and a placement for another E or ep is refused."""
    from torch import nn

    from lightning_moe_overlap.moe.ep import apply_expert_parallel
    from lightning_moe_overlap.moe.experts import Experts
    from lightning_moe_overlap.overlap.runtime import CommRuntime

    torch.manual_seed(0)
    holder = nn.Module()
    holder.experts = Experts(4, 8, 16)
    (module,) = apply_expert_parallel(holder, None, runtime=CommRuntime())
    x, indices = torch.randn(6, 8), torch.tensor([[0, 1], [2, 3], [3, 0], [1, 1], [2, 0], [4, 3]])  # 4: dropped
    weights = torch.rand(6, 2)
    expected = module(x, indices, weights)
    placement = ExpertPlacement((2, 0, 3, 1), 1)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(param[list(placement.experts)])  # slot s now holds expert placement.experts[s]
    module.set_placement(placement)
    assert torch.equal(module(x, indices, weights), expected)
    with pytest.raises(ValueError, match=r"the placement has 4 experts over ep=2, but this module holds 4 over ep=1"):
        module.set_placement(ExpertPlacement.identity(4, 2))


def test_a_module_with_a_replica_computes_the_experts_output_and_splits_the_gradient():
    """ep=1, one process, expert 0 replicated: the output is the module's without replicas (each row meets the same
    weights; GEMM blocking may differ with the row count), and the primary's gradient plus the replica's is the
    gradient without replicas (a reordered sum)."""
    from torch import nn

    from lightning_moe_overlap.moe.ep import apply_expert_parallel
    from lightning_moe_overlap.moe.experts import Experts
    from lightning_moe_overlap.overlap.runtime import CommRuntime

    torch.manual_seed(0)
    holder = nn.Module()
    holder.experts = Experts(4, 8, 16)
    (module,) = apply_expert_parallel(holder, None, runtime=CommRuntime())
    x, indices = torch.randn(6, 8), torch.tensor([[0, 1], [0, 3], [3, 0], [1, 1], [0, 2], [4, 0]])
    weights = torch.rand(6, 2)
    expected = module(x, indices, weights)
    expected.square().sum().backward()
    plain_grads = {name: p.grad.clone() for name, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    module.set_placement(ExpertPlacement((0, 1, 2, 3), 1, replicas=(0,)))
    rows = module.replica_slots.rows
    with torch.no_grad():
        for name, param in module.named_parameters():
            rows[name].copy_(param[:1])
    out = module(x, indices, weights)
    assert torch.allclose(out, expected, rtol=1e-6, atol=1e-6)
    out.square().sum().backward()
    for name, param in module.named_parameters():
        assert rows[name].grad is not None and rows[name].grad.abs().sum() > 0  # the replica took tokens
        summed = param.grad.clone()
        summed[0] += rows[name].grad[0]
        assert torch.allclose(summed, plain_grads[name], rtol=1e-5, atol=1e-6), name
    module.kernel = object()  # e.g. FP8's
    with pytest.raises(NotImplementedError, match=r"replicas of experts run on the torch backend's own GEMMs"):
        module.set_placement(ExpertPlacement((0, 1, 2, 3), 1, replicas=(0,)))
