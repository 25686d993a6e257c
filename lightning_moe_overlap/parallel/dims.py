"""Parallel sizes and the rank layout, as pure functions (no process group needed).

Rank layout. The dense view orders ranks as ``(pp, dp, cp, tp)`` with ``tp`` varying fastest::

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

Expert parallelism folds into the ``dp x cp x tp`` block of a pp stage, as Megatron-core's "parallel folding" with
expert tensor parallelism 1 (torchtitan's ``etp=1``): the expert view orders the same ranks as ``(pp, edp, ep)``,
where ``ep * edp == dp * cp * tp`` and ``ep`` varies fastest inside the block. Experts are never tensor-sharded;
with tensor parallelism each tp rank routes its own sequence shard (sequence parallelism), so the ep groups may span
tp ranks and no expert is held twice inside an ep group. The ranks of one ep group are neighbours, which puts it
inside a node whenever ``ep`` fits in one. Example, 8 ranks, ``ep=4``: ep groups ``[0,1,2,3]`` and ``[4,5,6,7]``;
edp groups (the ranks holding the same experts) ``[0,4] [1,5] [2,6] [3,7]``; with ``tp=2, ep=2`` the ep groups are
the tp pairs ``[0,1] [2,3] ...``. At ``tp = 1`` this is the layout of earlier versions, unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from lightning_moe_overlap._checks import divisors, is_positive_int

GroupKind = Literal["dp", "cp", "dp_cp", "tp", "cp_tp", "dp_cp_tp", "pp", "ep", "edp"]
GROUP_KINDS: tuple[GroupKind, ...] = ("dp", "cp", "dp_cp", "tp", "cp_tp", "dp_cp_tp", "pp", "ep", "edp")


class ParallelDimsError(ValueError):
    """Sizes that do not fit together. ``rule`` names the broken rule (``docs/validation.md``) and ``detail`` says
    what is wrong without naming the caller, so the strategy's validation reports the same text as its own."""

    def __init__(self, rule: str, detail: str) -> None:
        super().__init__(f"`ParallelDims`: {detail}")
        self.rule = rule
        self.detail = detail


@dataclass(frozen=True)
class RankCoords:
    """Where one rank sits in each view."""

    pp: int
    dp: int
    cp: int
    tp: int
    ep: int
    edp: int


@dataclass(frozen=True)
class ParallelDims:
    """The parallel sizes of a run. Build it with :meth:`from_world_size`, which infers ``dp`` and validates."""

    world_size: int
    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    vpp: int | None = None

    @classmethod
    def from_world_size(
        cls, world_size: int, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, vpp: int | None = None
    ) -> ParallelDims:
        """Infer ``dp = world_size / (pp * cp * tp)`` and check that the sizes fit together.

        Raises:
            ParallelDimsError: (a ``ValueError``) a size is not a positive integer, the world size is not a
                multiple of ``pp * cp * tp``, or ``ep`` does not divide ``dp * cp * tp``. The message lists the valid
                choices.
        """
        for name, value in (("world_size", world_size), ("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
            if not is_positive_int(value):
                raise ParallelDimsError("sizes", f"`{name}={value!r}` must be a positive integer.")
        if vpp is not None and not is_positive_int(vpp):
            raise ParallelDimsError("sizes", f"`vpp={vpp!r}` must be None or a positive integer.")
        model = pp * cp * tp
        if world_size % model != 0:
            raise ParallelDimsError(
                "world-size",
                f"world_size={world_size} (devices x num_nodes) is not a multiple of pp*cp*tp={model} "
                f"(pp={pp}, cp={cp}, tp={tp}); the rule is world_size = pp * dp * cp * tp. "
                f"Choose pp*cp*tp among the divisors of {world_size}: {divisors(world_size)}, "
                f"or run on a multiple of {model} processes.",
            )
        dp = world_size // model
        span = dp * cp * tp
        if span % ep != 0:
            raise ParallelDimsError(
                "ep-divides-dp-cp",
                f"ep={ep} does not divide dp*cp*tp={span} (dp={dp}, cp={cp}, tp={tp}, world_size={world_size}); "
                f"expert parallelism folds into the data-, context- and tensor-parallel ranks of a pipeline stage, so "
                f"ep must divide dp*cp*tp. Valid ep values here: {divisors(span)}; or run on a multiple of "
                f"{pp * math.lcm(ep, cp * tp)} processes.",
            )
        return cls(world_size=world_size, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, vpp=vpp)

    @property
    def ep_span(self) -> int:
        """The ranks of a pipeline stage, over which expert parallelism folds: ``dp * cp * tp``."""
        return self.dp * self.cp * self.tp

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: how many ranks hold a copy of the same experts."""
        return self.ep_span // self.ep

    def coords(self, rank: int) -> RankCoords:
        """The coordinates of ``rank`` in the dense ``(pp, dp, cp, tp)`` and expert ``(pp, edp, ep)`` views."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"`ParallelDims.coords`: rank={rank} is outside [0, world_size={self.world_size}).")
        tp_rank = rank % self.tp
        cp_rank = (rank // self.tp) % self.cp
        dp_rank = (rank // (self.tp * self.cp)) % self.dp
        pp_rank = rank // (self.tp * self.cp * self.dp)
        block = (dp_rank * self.cp + cp_rank) * self.tp + tp_rank  # index inside the dp x cp x tp block
        return RankCoords(pp=pp_rank, dp=dp_rank, cp=cp_rank, tp=tp_rank, ep=block % self.ep, edp=block // self.ep)

    def group_ranks(self, kind: GroupKind) -> list[list[int]]:
        """Every group of one kind, each as its sorted list of ranks; together they partition the world."""
        if kind not in GROUP_KINDS:
            raise ValueError(f"`ParallelDims.group_ranks`: unknown kind={kind!r}; valid kinds: {list(GROUP_KINDS)}.")
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            key = {
                "dp": (c.pp, c.cp, c.tp),
                "cp": (c.pp, c.dp, c.tp),
                "dp_cp": (c.pp, c.tp),
                "tp": (c.pp, c.dp, c.cp),
                "cp_tp": (c.pp, c.dp),
                "dp_cp_tp": (c.pp,),
                "pp": (c.dp, c.cp, c.tp),
                "ep": (c.pp, c.edp),
                "edp": (c.pp, c.ep),
            }[kind]
            groups.setdefault(key, []).append(rank)
        return list(groups.values())

    def group_of(self, kind: GroupKind, rank: int) -> list[int]:
        """The ranks of the group of ``kind`` that ``rank`` belongs to."""
        return next(g for g in self.group_ranks(kind) if rank in g)

    def describe(self) -> str:
        return (
            f"world_size={self.world_size}: dp={self.dp} tp={self.tp} pp={self.pp} cp={self.cp} "
            f"ep={self.ep} edp={self.edp} vpp={self.vpp}"
        )
