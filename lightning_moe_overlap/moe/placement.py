"""Where each expert lives: a placement maps logical experts to physical slots on the ep ranks.

An experts module's parameters hold ``E`` rows (one per expert), split in contiguous blocks over the ep ranks: ep
rank ``r`` holds rows ``[r * E / ep, (r + 1) * E / ep)``. Those rows are *slots*; a placement says which logical
expert each slot holds (``experts[slot]``). The identity (slot ``e`` holds expert ``e``) is the default and what
the dispatchers assumed before placements existed; any other one is a permutation, applied to the router's choices
just before the dispatch (:meth:`ExpertPlacement.to_slots`), so the dispatchers keep routing to contiguous blocks
and never see a logical index. The router, its losses, the token counts, the capacity drop and the checkpoints
stay logical (docs/expert_placement.md).

:func:`balanced_placement` chooses one from the tokens each expert received: the greedy packing of DeepSeek's EPLB
(heaviest expert first, onto the least loaded rank that has a free slot), or, when it balances as well and moves
fewer experts, trades from the current placement; the experts that stay on a rank keep their slots, so that few
rows move.

Shape legend: E experts (= slots), L slots per rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_moe_overlap._checks import is_positive_int


@dataclass(frozen=True)
class ExpertPlacement:
    """``experts[s]``: the logical expert primary slot ``s`` holds (slot ``s`` lives on ep rank ``s // (E / ep)``);
    ``replicas[j]``: the logical expert replica slot ``j`` copies (on ep rank ``j // (R / ep)``).

    The primary slots are the experts module's parameter rows; the replica slots are copies of them that the module
    keeps beside its parameters (``moe/ep.py``). In the dispatch, ep rank ``r`` holds ``(E + R) / ep`` slots: its
    ``E / ep`` primaries, then its ``R / ep`` replicas.

    Raises:
        ValueError: ``experts`` is not a permutation of ``range(E)``, ``ep`` does not divide ``E`` or ``R``, or a
            replica names no expert.
    """

    experts: tuple[int, ...]
    ep: int
    replicas: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        num = len(self.experts)
        if not is_positive_int(self.ep) or num == 0 or num % self.ep or len(self.replicas) % self.ep:
            raise ValueError(
                f"`ExpertPlacement`: {num} slots and {len(self.replicas)} replicas over ep={self.ep!r}; every ep rank "
                "holds the same number of slots and of replicas (E % ep == 0 and R % ep == 0, ep >= 1). Build it for "
                "the experts module's E and the run's ep, with a multiple of ep replicas."
            )
        if sorted(self.experts) != list(range(num)):
            raise ValueError(
                f"`ExpertPlacement`: experts={list(self.experts)} is not a permutation of 0..{num - 1}; each "
                "logical expert must sit in exactly one slot. Pass every expert once."
            )
        if any(not 0 <= e < num for e in self.replicas):
            raise ValueError(
                f"`ExpertPlacement`: replicas={list(self.replicas)} names experts outside 0..{num - 1}; a replica "
                "copies one of the module's experts."
            )

    @classmethod
    def identity(cls, num_experts: int, ep: int) -> ExpertPlacement:
        """Slot ``e`` holds expert ``e``, no replicas: the contiguous-block placement of a run without re-placement."""
        return cls(tuple(range(num_experts)), ep)

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    @property
    def slots_per_rank(self) -> int:
        """Primary slots per ep rank (``E / ep``)."""
        return self.num_experts // self.ep

    @property
    def replicas_per_rank(self) -> int:
        return len(self.replicas) // self.ep

    @property
    def is_identity(self) -> bool:
        return not self.replicas and all(e == s for s, e in enumerate(self.experts))

    def slot_of(self) -> list[int]:
        """``slot_of[e]``: the primary slot holding logical expert ``e`` (the inverse permutation)."""
        slots = [0] * self.num_experts
        for slot, expert in enumerate(self.experts):
            slots[expert] = slot
        return slots

    def rank_of(self, expert: int) -> int:
        """The ep rank holding logical expert ``expert``'s primary."""
        return self.slot_of()[expert] // self.slots_per_rank

    def copies(self) -> list[int]:
        """``copies[e]``: how many slots hold expert ``e`` (1 + its replicas)."""
        counts = [1] * self.num_experts
        for expert in self.replicas:
            counts[expert] += 1
        return counts

    def rank_loads(self, counts_E: Sequence[float]) -> list[float]:
        """Tokens per ep rank under this placement, from the tokens per logical expert (an expert's tokens split
        evenly over its copies)."""
        loads, copies = [0.0] * self.ep, self.copies()
        for slot, expert in enumerate(self.experts):
            loads[slot // self.slots_per_rank] += float(counts_E[expert]) / copies[expert]
        for slot, expert in enumerate(self.replicas):
            loads[slot // self.replicas_per_rank] += float(counts_E[expert]) / copies[expert]
        return loads

    def share_matrix(self, device: torch.device) -> Tensor:
        """``[E, ep]`` float64: the share of expert ``e``'s tokens that rank ``r`` computes (``counts_E @ it`` is
        :meth:`rank_loads` on the device)."""
        shares = torch.zeros(self.num_experts, self.ep, dtype=torch.float64)
        copies = self.copies()
        for slot, expert in enumerate(self.experts):
            shares[expert, slot // self.slots_per_rank] += 1.0 / copies[expert]
        for slot, expert in enumerate(self.replicas):
            shares[expert, slot // self.replicas_per_rank] += 1.0 / copies[expert]
        return shares.to(device)

    def imbalance(self, counts_E: Sequence[float]) -> float:
        """The most loaded rank's tokens over the mean rank's (1.0: even; 0.0 when no token was counted)."""
        loads = self.rank_loads(counts_E)
        mean = sum(loads) / self.ep
        return max(loads) / mean if mean > 0 else 0.0

    def moved_experts(self, new: ExpertPlacement) -> list[int]:
        """The logical experts whose primary's ep rank differs in ``new`` (their rows cross ranks)."""
        before, after = self.slot_of(), new.slot_of()
        per_rank = self.slots_per_rank
        return [e for e in range(self.num_experts) if before[e] // per_rank != after[e] // per_rank]

    def slot_table(self, device: torch.device) -> Tensor:
        """``slot_of`` as an int64 tensor on ``device`` (what :meth:`to_slots` indexes)."""
        return torch.tensor(self.slot_of(), dtype=torch.int64, device=device)

    def dispatch_slot(self, expert: int, copy: int) -> int:
        """The dispatch slot of copy ``copy`` of ``expert`` (0: its primary, then its replicas in slot order)."""
        per_rank = self.slots_per_rank + self.replicas_per_rank
        if copy == 0:
            slot = self.slot_of()[expert]
            return (slot // self.slots_per_rank) * per_rank + slot % self.slots_per_rank
        slot = [j for j, e in enumerate(self.replicas) if e == expert][copy - 1]
        rank = slot // self.replicas_per_rank
        return rank * per_rank + self.slots_per_rank + slot % self.replicas_per_rank

    def copy_table(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """``(copies_EC, num_E)``: the dispatch slot of each copy of each expert (a row padded with its last copy)
        and the copies per expert, on ``device`` (what :meth:`to_copies` indexes)."""
        copies = self.copies()
        width = max(copies)
        table = [[self.dispatch_slot(e, min(c, copies[e] - 1)) for c in range(width)] for e in range(self.num_experts)]
        return (torch.tensor(table, dtype=torch.int64, device=device),
                torch.tensor(copies, dtype=torch.int64, device=device))  # fmt: skip

    @staticmethod
    def to_slots(indices_TK: Tensor, table_E: Tensor) -> Tensor:
        """The router's logical choices as slots (``table_E`` from :meth:`slot_table`); indices outside ``[0, E)``
        mark dropped choices and stay as they are. No host read."""
        num_experts = table_E.shape[0]
        kept = (indices_TK >= 0) & (indices_TK < num_experts)
        slots = table_E[indices_TK.clamp(0, num_experts - 1).long()]
        return torch.where(kept, slots.to(indices_TK.dtype), indices_TK)

    @staticmethod
    def to_copies(indices_TK: Tensor, copies_EC: Tensor, num_E: Tensor, num_slots: int) -> Tensor:
        """The router's logical choices as dispatch slots when experts have replicas (tables from
        :meth:`copy_table`; ``num_slots``: ``E + R``): the ``i``-th choice of expert ``e`` in this call (in token
        order) goes to copy ``i % copies[e]``, so each copy gets an even share (within one) of every rank's choices
        of ``e``; dropped choices (outside ``[0, E)``) become ``num_slots`` and stay dropped. No host read."""
        num_experts = copies_EC.shape[0]
        flat = indices_TK.reshape(-1).long()
        kept = (flat >= 0) & (flat < num_experts)
        key = torch.where(kept, flat, num_experts)
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=num_experts + 1)
        starts = torch.cumsum(counts, 0) - counts
        occurrence = torch.empty_like(key)
        occurrence[order] = torch.arange(key.numel(), device=key.device) - starts[key[order]]
        expert = key.clamp(max=num_experts - 1)
        slots = copies_EC[expert, torch.remainder(occurrence, num_E[expert])]
        return torch.where(kept, slots, num_slots).view(indices_TK.shape).to(indices_TK.dtype)


# A placement that moves fewer experts is preferred when its most loaded rank is within this fraction of the packing's.
FEWER_MOVES_TOLERANCE = 0.01


def balanced_placement(counts_E: Sequence[float], current: ExpertPlacement, replicas: int = 0) -> ExpertPlacement:
    """A placement over ``current.ep`` ranks whose most loaded rank carries as few tokens as the greedy packing
    finds, moving few experts away from ``current``; with ``replicas`` (a multiple of ep), that many replica slots.

    Replicas first (EPLB's rule): one at a time to the expert with the most tokens per copy; an expert's tokens are
    then shared evenly by its copies. Primaries: two candidates on those shares, the greedy packing (experts by
    decreasing share, ties by lower index, each onto the rank with the fewest tokens so far among those with a free
    slot; the packed groups then named after the ranks holding most of their experts now), and trades from
    ``current`` (the most loaded rank swaps one expert with another rank while that lowers the pair's larger load).
    The trades win when their most loaded rank is within :data:`FEWER_MOVES_TOLERANCE` of the packing's and they
    move fewer experts. An expert that stays on its rank keeps its slot. Replicas last: the largest shares first,
    each onto the least loaded rank with a free replica slot, a rank without a copy of that expert if one has room.
    With replicas, the current primaries with new replicas (no parameter rows move, the replicas are refreshed at
    every step anyway) win when within :data:`FEWER_MOVES_TOLERANCE` of that choice.
    """
    num, ep = current.num_experts, current.ep
    if len(counts_E) != num:
        raise ValueError(
            f"`balanced_placement`: {len(counts_E)} counts for a placement of {num} experts; pass one count per "
            "logical expert."
        )
    if not isinstance(replicas, int) or replicas < 0 or replicas % ep:
        raise ValueError(
            f"`balanced_placement`: replicas={replicas!r} must be a non-negative multiple of ep={ep} (every rank "
            "holds the same number of replica slots)."
        )
    copies = _copies(counts_E, num, replicas)
    shares = [float(c) / n for c, n in zip(counts_E, copies)]
    packed = _slotted(_named(_packed(shares, ep, current.slots_per_rank), current), current)
    swapped = _slotted(_swapped(shares, current), current)
    packed_max = max(packed.rank_loads(shares))
    fewer = len(current.moved_experts(swapped)) < len(current.moved_experts(packed))
    primaries = (
        swapped if fewer and max(swapped.rank_loads(shares)) <= packed_max * (1 + FEWER_MOVES_TOLERANCE) else packed
    )
    chosen = _with_replicas(primaries, shares, copies, replicas // ep)
    if replicas and current.moved_experts(primaries):  # new replicas alone move no rows: kept if nearly as even
        kept = _with_replicas(ExpertPlacement(current.experts, ep), shares, copies, replicas // ep)
        if max(kept.rank_loads(counts_E)) <= max(chosen.rank_loads(counts_E)) * (1 + FEWER_MOVES_TOLERANCE):
            return kept
    return _roles_kept(chosen, current)


def _roles_kept(placement: ExpertPlacement, current: ExpertPlacement) -> ExpertPlacement:
    """``placement`` with primary and replica roles traded back where that moves fewer primaries and leaves every
    rank holding the same copies: expert ``e`` whose primary moved from rank ``a`` to ``b`` while a replica of it
    stays on ``a``, and an expert ``f`` with its primary on ``a`` and a replica on ``b``, trade both roles (the same
    loads; ``e``'s rows need not move)."""
    if not placement.replicas:
        return placement
    per_rank, rep_per_rank = placement.slots_per_rank, placement.replicas_per_rank
    experts, replicas = list(placement.experts), list(placement.replicas)
    rank_before = [slot // per_rank for slot in current.slot_of()]
    for _ in range(len(experts)):
        slot_of = {e: s for s, e in enumerate(experts)}
        found = None
        for e in range(len(experts)):
            a, b = rank_before[e], slot_of[e] // per_rank
            here = [j for j, r in enumerate(replicas) if r == e and j // rep_per_rank == a]
            if a == b or not here:
                continue
            for f in (experts[s] for s in range(a * per_rank, (a + 1) * per_rank)):
                there = [j for j, r in enumerate(replicas) if r == f and j // rep_per_rank == b]
                if there and rank_before[f] != a:
                    found = (e, f, here[0], there[0])
                    break
            if found:
                break
        if found is None:
            break
        e, f, j_e, j_f = found
        s_e, s_f = slot_of[e], slot_of[f]
        experts[s_e], experts[s_f] = f, e
        replicas[j_e], replicas[j_f] = f, e
    traded = ExpertPlacement(tuple(experts), placement.ep, tuple(replicas))
    return _slotted([list(g) for g in _groups(traded)], current, traded.replicas)


def balanced_within_nodes(
    counts_E: Sequence[float], current: ExpertPlacement, replicas: int, node_of_rank: Sequence[int]
) -> ExpertPlacement:
    """:func:`balanced_placement` within each node: the ranks of a node (``node_of_rank[r]``) share out the experts
    they hold now, with their share of the replicas, and no expert leaves its node. A router whose choices are
    limited to a few nodes (DeepSeek's group-limited routing over experts laid out by node) keeps that bound."""
    ep, per_rank = current.ep, current.slots_per_rank
    if len(node_of_rank) != ep:
        raise ValueError(
            f"`balanced_within_nodes`: node_of_rank has {len(node_of_rank)} entries for ep={ep}; pass the node of "
            "every ep rank."
        )
    if len(set(node_of_rank)) == 1:
        return balanced_placement(counts_E, current, replicas)
    replicas_per_rank = replicas // ep if replicas % ep == 0 else -1
    if replicas_per_rank < 0:
        raise ValueError(
            f"`balanced_within_nodes`: replicas={replicas!r} must be a non-negative multiple of ep={ep} (every rank "
            "holds the same number of replica slots)."
        )
    experts, chosen = list(current.experts), [0] * replicas
    for node in sorted(set(node_of_rank)):
        ranks = [r for r in range(ep) if node_of_rank[r] == node]
        slots = [r * per_rank + i for r in ranks for i in range(per_rank)]
        members = sorted(current.experts[s] for s in slots)
        index = {e: i for i, e in enumerate(members)}
        here = ExpertPlacement(tuple(index[current.experts[s]] for s in slots), len(ranks))
        placed = balanced_placement([counts_E[e] for e in members], here, replicas_per_rank * len(ranks))
        for k, slot in enumerate(slots):
            experts[slot] = members[placed.experts[k]]
        for k, rank in enumerate(ranks):
            for i in range(replicas_per_rank):
                chosen[rank * replicas_per_rank + i] = members[placed.replicas[k * replicas_per_rank + i]]
    return ExpertPlacement(tuple(experts), ep, tuple(chosen))


def _copies(counts_E: Sequence[float], num: int, replicas: int) -> list[int]:
    """Copies per expert: one each, then ``replicas`` more, each to the most tokens per copy (ties: lower index)."""
    copies = [1] * num
    for _ in range(replicas):
        expert = max(range(num), key=lambda e: (float(counts_E[e]) / copies[e], -e))
        copies[expert] += 1
    return copies


def _with_replicas(
    primaries: ExpertPlacement, shares: list[float], copies: list[int], per_rank: int
) -> ExpertPlacement:
    """``primaries`` plus the replica slots of ``copies``, packed by share onto the least loaded ranks."""
    if not per_rank:
        return primaries
    ep = primaries.ep
    loads = primaries.rank_loads(shares)
    holders = [{primaries.rank_of(e)} for e in range(len(copies))]
    slots: list[list[int]] = [[] for _ in range(ep)]
    wanted = [e for e in range(len(copies)) for _ in range(copies[e] - 1)]
    for expert in sorted(wanted, key=lambda e: (-shares[e], e)):
        free = [r for r in range(ep) if len(slots[r]) < per_rank]
        fresh = [r for r in free if r not in holders[expert]] or free
        rank = min(fresh, key=lambda r: (loads[r], r))
        slots[rank].append(expert)
        holders[expert].add(rank)
        loads[rank] += shares[expert]
    return ExpertPlacement(primaries.experts, ep, tuple(e for rank in slots for e in sorted(rank)))


def _groups(placement: ExpertPlacement) -> list[list[int]]:
    per_rank = placement.slots_per_rank
    return [list(placement.experts[r * per_rank : (r + 1) * per_rank]) for r in range(placement.ep)]


def _packed(counts: list[float], ep: int, per_rank: int) -> list[list[int]]:
    """The greedy packing (EPLB's): heaviest first onto the least loaded rank with a free slot."""
    groups: list[list[int]] = [[] for _ in range(ep)]
    loads = [0.0] * ep
    for expert in sorted(range(len(counts)), key=lambda e: (-counts[e], e)):
        group = min((g for g in range(ep) if len(groups[g]) < per_rank), key=lambda g: (loads[g], g))
        groups[group].append(expert)
        loads[group] += counts[expert]
    return groups


def _named(groups: list[list[int]], current: ExpertPlacement) -> list[list[int]]:
    """The groups reordered by rank: each to the rank holding most of its experts now (largest overlaps first)."""
    ep, rank_now = current.ep, [slot // current.slots_per_rank for slot in current.slot_of()]
    overlaps = sorted(
        ((sum(rank_now[e] == r for e in groups[g]), g, r) for g in range(ep) for r in range(ep)),
        key=lambda item: (-item[0], item[1], item[2]),
    )
    by_rank: dict[int, list[int]] = {}
    named: set[int] = set()
    for _, group, rank in overlaps:
        if group not in named and rank not in by_rank:
            by_rank[rank] = groups[group]
            named.add(group)
    return [by_rank[r] for r in range(ep)]


def _swapped(counts: list[float], current: ExpertPlacement) -> list[list[int]]:
    """From ``current``: while some trade of one expert between the most loaded rank and another lowers the
    pair's larger load, make the best such trade."""
    groups = _groups(current)
    loads = [sum(counts[e] for e in g) for g in groups]
    for _ in range(current.num_experts):
        top = max(range(current.ep), key=lambda r: (loads[r], -r))
        best: tuple[float, int, int, int] | None = None
        for other in range(current.ep):
            if other == top:
                continue
            for i, x in enumerate(groups[top]):
                for j, y in enumerate(groups[other]):
                    larger = max(loads[top] - counts[x] + counts[y], loads[other] - counts[y] + counts[x])
                    if larger < loads[top] and (best is None or larger < best[0]):
                        best = (larger, other, i, j)
        if best is None:
            break
        _, other, i, j = best
        x, y = groups[top][i], groups[other][j]
        groups[top][i], groups[other][j] = y, x
        loads[top] += counts[y] - counts[x]
        loads[other] += counts[x] - counts[y]
    return groups


def _slotted(groups: list[list[int]], current: ExpertPlacement, replicas: tuple[int, ...] = ()) -> ExpertPlacement:
    """The placement with ``groups[r]`` on rank ``r`` (and ``replicas``): experts already there keep their slots."""
    per_rank, slot_now = current.slots_per_rank, current.slot_of()
    experts: list[int | None] = [None] * current.num_experts
    for rank, members in enumerate(groups):
        arriving = []
        for expert in members:
            if slot_now[expert] // per_rank == rank:
                experts[slot_now[expert]] = expert
            else:
                arriving.append(expert)
        free = [s for s in range(rank * per_rank, (rank + 1) * per_rank) if experts[s] is None]
        for slot, expert in zip(free, sorted(arriving)):
            experts[slot] = expert
    return ExpertPlacement(tuple(int(e) for e in experts), current.ep, replicas)  # type: ignore[arg-type]
