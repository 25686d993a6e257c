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
    """``experts[s]``: the logical expert slot ``s`` holds; slot ``s`` lives on ep rank ``s // (E / ep)``.

    Raises:
        ValueError: ``experts`` is not a permutation of ``range(E)``, or ``ep`` does not divide ``E``.
    """

    experts: tuple[int, ...]
    ep: int

    def __post_init__(self) -> None:
        num = len(self.experts)
        if not is_positive_int(self.ep) or num == 0 or num % self.ep:
            raise ValueError(
                f"`ExpertPlacement`: {num} slots over ep={self.ep!r}; every ep rank holds the same number of slots "
                "(E % ep == 0, ep >= 1). Build it for the experts module's E and the run's ep."
            )
        if sorted(self.experts) != list(range(num)):
            raise ValueError(
                f"`ExpertPlacement`: experts={list(self.experts)} is not a permutation of 0..{num - 1}; each "
                "logical expert must sit in exactly one slot. Pass every expert once."
            )

    @classmethod
    def identity(cls, num_experts: int, ep: int) -> ExpertPlacement:
        """Slot ``e`` holds expert ``e``: the contiguous-block placement of a run without re-placement."""
        return cls(tuple(range(num_experts)), ep)

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    @property
    def slots_per_rank(self) -> int:
        return self.num_experts // self.ep

    @property
    def is_identity(self) -> bool:
        return all(e == s for s, e in enumerate(self.experts))

    def slot_of(self) -> list[int]:
        """``slot_of[e]``: the slot holding logical expert ``e`` (the inverse permutation)."""
        slots = [0] * self.num_experts
        for slot, expert in enumerate(self.experts):
            slots[expert] = slot
        return slots

    def rank_of(self, expert: int) -> int:
        """The ep rank holding logical expert ``expert``."""
        return self.slot_of()[expert] // self.slots_per_rank

    def rank_loads(self, counts_E: Sequence[float]) -> list[float]:
        """Tokens per ep rank under this placement, from the tokens per logical expert."""
        loads = [0.0] * self.ep
        for slot, expert in enumerate(self.experts):
            loads[slot // self.slots_per_rank] += float(counts_E[expert])
        return loads

    def imbalance(self, counts_E: Sequence[float]) -> float:
        """The most loaded rank's tokens over the mean rank's (1.0: even; 0.0 when no token was counted)."""
        loads = self.rank_loads(counts_E)
        mean = sum(loads) / self.ep
        return max(loads) / mean if mean > 0 else 0.0

    def moved_experts(self, new: ExpertPlacement) -> list[int]:
        """The logical experts whose ep rank differs in ``new`` (their rows cross ranks)."""
        before, after = self.slot_of(), new.slot_of()
        per_rank = self.slots_per_rank
        return [e for e in range(self.num_experts) if before[e] // per_rank != after[e] // per_rank]

    def slot_table(self, device: torch.device) -> Tensor:
        """``slot_of`` as an int64 tensor on ``device`` (what :meth:`to_slots` indexes)."""
        return torch.tensor(self.slot_of(), dtype=torch.int64, device=device)

    @staticmethod
    def to_slots(indices_TK: Tensor, table_E: Tensor) -> Tensor:
        """The router's logical choices as slots (``table_E`` from :meth:`slot_table`); indices outside ``[0, E)``
        mark dropped choices and stay as they are. No host read."""
        num_experts = table_E.shape[0]
        kept = (indices_TK >= 0) & (indices_TK < num_experts)
        slots = table_E[indices_TK.clamp(0, num_experts - 1).long()]
        return torch.where(kept, slots.to(indices_TK.dtype), indices_TK)


# A placement that moves fewer experts is preferred when its most loaded rank is within this fraction of the packing's.
FEWER_MOVES_TOLERANCE = 0.01


def balanced_placement(counts_E: Sequence[float], current: ExpertPlacement) -> ExpertPlacement:
    """A placement over ``current.ep`` ranks whose most loaded rank carries as few tokens as the greedy packing
    finds, moving few experts away from ``current``.

    Two candidates: the greedy packing (experts by decreasing count, ties by lower index, each onto the rank with
    the fewest tokens so far among those with a free slot; the packed groups then named after the ranks holding
    most of their experts now), and swaps from ``current`` (the most loaded rank trades one expert with another
    rank while that lowers the pair's larger load). The swaps win when their most loaded rank is within
    :data:`FEWER_MOVES_TOLERANCE` of the packing's and they move fewer experts. Slots: an expert that stays on its
    rank keeps its slot; the others take the free slots in increasing order.
    """
    num, ep = current.num_experts, current.ep
    if len(counts_E) != num:
        raise ValueError(
            f"`balanced_placement`: {len(counts_E)} counts for a placement of {num} experts; pass one count per "
            "logical expert."
        )
    counts = [float(c) for c in counts_E]
    packed = _slotted(_named(_packed(counts, ep, current.slots_per_rank), current), current)
    swapped = _slotted(_swapped(counts, current), current)
    packed_max, swapped_max = max(packed.rank_loads(counts)), max(swapped.rank_loads(counts))
    fewer = len(current.moved_experts(swapped)) < len(current.moved_experts(packed))
    return swapped if fewer and swapped_max <= packed_max * (1.0 + FEWER_MOVES_TOLERANCE) else packed


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


def _slotted(groups: list[list[int]], current: ExpertPlacement) -> ExpertPlacement:
    """The placement with ``groups[r]`` on rank ``r``: experts already there keep their slots."""
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
    return ExpertPlacement(tuple(int(e) for e in experts), current.ep)  # type: ignore[arg-type]
