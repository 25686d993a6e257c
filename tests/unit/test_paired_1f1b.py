"""The paired 1F1B order (``pipeline/paired_1f1b.py``) against an event simulation written here, not the product's.

The simulation runs each stage's actions in order; an action starts when its stage is free and its inputs have
arrived: a forward of micro-batch ``j`` needs stage ``s - 1``'s forward of ``j``, a backward of ``k`` needs stage
``s + 1``'s backward of ``k`` and this stage's forward of ``k``; a pair needs both and delivers both outputs when it
ends. A forward lasts 1, a backward 2, a pair 3 (the two run on one device). An action that can never start is a
deadlock. Oracles: every forward and backward once, the backwards in 1F1B's order; no deadlock at any ``M >= pp``;
every stage's pairs run back to back (no idle time between its first and last pair); and the rule's reason: with
warm-ups one apart instead of two, neighbouring stages idle between their pairs.
"""

from __future__ import annotations

import itertools

import pytest

from lightning_moe_overlap._compat import torch as torch_compat
from lightning_moe_overlap.pipeline.paired_1f1b import paired_1f1b_order, pairs_per_stage, warmup

DURATION = {"F": 1, "B": 2, "OVERLAP_F_B": 3}


def _work(action) -> list[tuple[str, int, int]]:
    """``(kind, stage, micro-batch)`` of an action or of a pair's two sub-actions."""
    if torch_compat.action_kind(action) == "OVERLAP_F_B":
        return [_work(a)[0] for a in action.sub_actions]
    return [(torch_compat.action_kind(action), action.stage_index, action.microbatch_index)]


def simulate(order: dict[int, list], pp: int) -> dict[int, list[tuple[float, float, str]]]:
    """Each stage's ``(start, end, kind)`` per action; raises ``RuntimeError`` on a deadlock."""
    done: dict[tuple[str, int, int], float] = {}
    position = dict.fromkeys(order, 0)
    free = dict.fromkeys(order, 0.0)
    spans: dict[int, list[tuple[float, float, str]]] = {s: [] for s in order}

    def ready(kind: str, stage: int, micro: int) -> float | None:
        needs = []
        if kind == "F" and stage > 0:
            needs.append(("F", stage - 1, micro))
        if kind == "B":
            needs.append(("F", stage, micro))
            if stage < pp - 1:
                needs.append(("B", stage + 1, micro))
        if any(n not in done for n in needs):
            return None
        return max((done[n] for n in needs), default=0.0)

    while any(position[s] < len(order[s]) for s in order):
        progressed = False
        for stage in order:
            if position[stage] == len(order[stage]):
                continue
            action = order[stage][position[stage]]
            times = [ready(*w) for w in _work(action)]
            if any(t is None for t in times):
                continue
            kind = torch_compat.action_kind(action)
            start = max([free[stage], *times])
            end = start + DURATION[kind]
            for w in _work(action):
                done[w] = end
            spans[stage].append((start, end, kind))
            free[stage], position[stage], progressed = end, position[stage] + 1, True
        if not progressed:
            stuck = {s: str(order[s][position[s]]) for s in order if position[s] < len(order[s])}
            raise RuntimeError(f"deadlock: {stuck}")
    return spans


def _one_apart(pp: int, m: int) -> dict[int, list]:
    """The order with plain 1F1B's one-more-micro-batch warm-ups (``pp - s``): the rule's counter-example."""
    order = {}
    for stage in range(pp):
        w = min(pp - stage, m)
        actions = [torch_compat.pipeline_action(stage, "F", j) for j in range(w)]
        for k in range(m - w):
            pair = (torch_compat.pipeline_action(stage, "F", w + k), torch_compat.pipeline_action(stage, "B", k))
            actions.append(torch_compat.pipeline_action(-1, "OVERLAP_F_B", None, pair))
        actions += [torch_compat.pipeline_action(stage, "B", k) for k in range(m - w, m)]
        order[stage] = actions
    return order


def _idle_between_pairs(spans: list[tuple[float, float, str]]) -> float:
    pairs = [(s, e) for s, e, kind in spans if kind == "OVERLAP_F_B"]
    return sum(b[0] - a[1] for a, b in itertools.pairwise(pairs))


@pytest.mark.parametrize("pp", [2, 3, 4, 6])
def test_every_stage_runs_1f1bs_work_in_its_order_without_deadlock(pp: int) -> None:
    for m in (pp, pp + 1, 2 * pp - 1, 2 * pp, 2 * pp + 1, 4 * pp):
        order = paired_1f1b_order(pp, m)
        assert sorted(order) == list(range(pp))
        for stage, actions in order.items():
            work = [w for a in actions for w in _work(a)]
            assert sorted(w for w in work if w[0] == "F") == [("F", stage, j) for j in range(m)]
            assert [w for w in work if w[0] == "B"] == [("B", stage, k) for k in range(m)]  # 1F1B's order
        assert pairs_per_stage(pp, m) == [m - warmup(pp, s, m) for s in range(pp)]
        spans = simulate(order, pp)  # raises on a deadlock
        assert all(len(spans[s]) == len(order[s]) for s in order)


@pytest.mark.parametrize("pp", [2, 4])
def test_pairs_run_back_to_back_and_warmups_one_apart_would_not(pp: int) -> None:
    m = 4 * pp
    spans = simulate(paired_1f1b_order(pp, m), pp)
    assert all(_idle_between_pairs(spans[s]) == 0 for s in range(pp)), spans
    assert all(pairs_per_stage(pp, m)), "every stage pairs from M = 2 pp on"
    one_apart = simulate(_one_apart(pp, m), pp)
    assert all(_idle_between_pairs(one_apart[s]) > 0 for s in range(pp)), one_apart


def test_the_first_stages_pair_only_from_two_micro_batches_per_stage_on() -> None:
    assert pairs_per_stage(4, 4) == [0, 0, 1, 3]
    assert pairs_per_stage(4, 8) == [1, 3, 5, 7]
    assert [warmup(4, s, 8) for s in range(4)] == [7, 5, 3, 1]


def test_torchs_lowering_schedules_every_send_and_receive() -> None:
    """torch's own pass over the order (it raises on a receive that no send can match)."""
    schedules = torch_compat.pipeline_schedules()
    for pp, m in ((2, 2), (2, 5), (4, 9)):
        lowered = schedules._add_send_recv(paired_1f1b_order(pp, m), stage_to_rank=lambda s: s, num_stages=pp)
        sends = sum(torch_compat.action_kind(a).startswith("SEND") for acts in lowered.values() for a in acts)
        recvs = sum(torch_compat.action_kind(a).startswith("RECV") for acts in lowered.values() for a in acts)
        assert sends == recvs == 2 * (pp - 1) * m
