"""Process groups for every parallel dimension, built once and passed explicitly (never stored globally)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

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
    the one it belongs to. On NCCL the ep groups get a high-priority stream (see :func:`group_options`).
    """
    if not dist.is_initialized():
        raise RuntimeError("`build_groups` needs an initialised default process group; call it after init.")
    if dist.get_world_size() != dims.world_size:
        raise RuntimeError(
            f"`build_groups`: the process group has world_size={dist.get_world_size()} but the dims were built "
            f"for world_size={dims.world_size}. Build `ParallelDims` from the running world size."
        )
    resolved = backend or str(dist.get_backend())
    mine: dict[str, ProcessGroup] = {}
    for kind in GROUP_KINDS:
        options = group_options(kind, resolved)
        for ranks in dims.group_ranks(kind):
            group = dist.new_group(ranks, backend=backend, timeout=timeout, pg_options=options)
            if rank in ranks:
                mine[kind] = group
    return ParallelGroups(dims=dims, rank=rank, **mine)


def group_options(kind: str, backend: str) -> Any:
    """Backend options of the ``kind`` groups: ``None`` except for the ep groups on NCCL.

    The ep all-to-all is the communication the overlap hides; NCCL's high-priority stream lets its kernels be
    scheduled ahead of the compute kernels that fill the device meanwhile (Megatron sets the same for ep).
    """
    if kind != "ep" or backend.lower() != "nccl":
        return None
    options = dist.ProcessGroupNCCL.Options()  # only on NCCL builds of torch, reached only with an NCCL backend
    options.is_high_priority_stream = True
    return options
