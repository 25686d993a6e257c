"""Process groups for every parallel dimension, built once and passed explicitly (never stored globally)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_moe_overlap.parallel.dims import GROUP_KINDS, ParallelDims, RankCoords


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's process group in each dimension, plus the sizes they were built from.

    ``dp_cp`` is the group dense gradients are averaged over; ``edp`` the one expert gradients are averaged over;
    ``ep`` the one tokens are exchanged in.
    """

    dims: ParallelDims
    rank: int
    dp: ProcessGroup
    cp: ProcessGroup
    dp_cp: ProcessGroup
    tp: ProcessGroup
    pp: ProcessGroup
    ep: ProcessGroup
    edp: ProcessGroup

    @property
    def coords(self) -> RankCoords:
        return self.dims.coords(self.rank)


def build_groups(
    dims: ParallelDims, rank: int, *, backend: str | None = None, timeout: timedelta | None = None
) -> ParallelGroups:
    """Create the groups of every kind. Collective: every rank must call it with the same ``dims``.

    Every rank creates every group in the same order (``torch.distributed.new_group`` requires it) and keeps
    the one it belongs to.
    """
    if not dist.is_initialized():
        raise RuntimeError("`build_groups` needs an initialised default process group; call it after init.")
    if dist.get_world_size() != dims.world_size:
        raise RuntimeError(
            f"`build_groups`: the process group has world_size={dist.get_world_size()} but the dims were built "
            f"for world_size={dims.world_size}. Build `ParallelDims` from the running world size."
        )
    mine: dict[str, ProcessGroup] = {}
    for kind in GROUP_KINDS:
        for ranks in dims.group_ranks(kind):
            group = dist.new_group(ranks, backend=backend, timeout=timeout)
            if rank in ranks:
                mine[kind] = group
    return ParallelGroups(dims=dims, rank=rank, **mine)
