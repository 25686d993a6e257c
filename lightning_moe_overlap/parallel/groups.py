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
    ``ep`` the one tokens are exchanged in; ``dp_cp_tp`` (a pipeline stage) the one whose ranks see distinct tokens
    (with tensor parallelism each tp rank holds its own sequence shard), over which token counts are summed. The strategy reads them off its one mesh
    (``ParallelMesh.process_groups``: each kind is its view's group); :func:`build_groups` makes plain groups
    without a mesh, where kinds with the same members may be the same object and every kind of size 1 is this
    rank's one single-rank group.
    """

    dims: ParallelDims
    rank: int
    dp: ProcessGroup
    cp: ProcessGroup
    dp_cp: ProcessGroup
    tp: ProcessGroup
    dp_cp_tp: ProcessGroup
    pp: ProcessGroup
    ep: ProcessGroup
    edp: ProcessGroup

    @property
    def coords(self) -> RankCoords:
        return self.dims.coords(self.rank)


def build_groups(
    dims: ParallelDims, rank: int, *, backend: str | None = None, timeout: timedelta | None = None
) -> ParallelGroups:
    """Create the groups the layout uses. Collective: every rank must call it with the same ``dims``.

    Only what is used is built:

    - a kind whose groups hold one rank each (a dimension of size 1) gets no group of its own: all such kinds share
      one single-rank group per process, which the rank makes alone (``use_local_synchronization``, no collective);
    - kinds that split the ranks alike share one group (``dp`` and ``dp_cp`` when ``cp=1``, ``dp_cp`` and ``edp``
      when ``ep=1``), except ``ep``: the all-to-all the overlap hides keeps a communicator of its own, on NCCL with a
      high-priority stream (see :func:`group_options`).

    The other groups are created by every rank in the same order (kinds in ``GROUP_KINDS`` order, each kind's groups
    in rank order), as ``torch.distributed.new_group`` requires, and each rank keeps the one it belongs to.
    """
    if not dist.is_initialized():
        raise RuntimeError("`build_groups` needs an initialised default process group; call it after init.")
    if dist.get_world_size() != dims.world_size:
        raise RuntimeError(
            f"`build_groups`: the process group has world_size={dist.get_world_size()} but the dims were built "
            f"for world_size={dims.world_size}. Build `ParallelDims` from the running world size."
        )
    resolved = backend or str(dist.get_backend())
    solo: ProcessGroup | None = None
    built: dict[tuple[object, ...], ProcessGroup] = {}  # (partition, own communicator?) -> this rank's group
    mine: dict[str, ProcessGroup] = {}
    for kind in GROUP_KINDS:
        partition = dims.group_ranks(kind)
        if len(partition[0]) == 1:
            if solo is None:
                solo = dist.new_group([rank], backend=backend, timeout=timeout, use_local_synchronization=True)
            mine[kind] = solo
            continue
        key = (tuple(map(tuple, partition)), kind == "ep")
        if key not in built:
            options = group_options(kind, resolved)
            for ranks in partition:
                group = dist.new_group(ranks, backend=backend, timeout=timeout, pg_options=options)
                if rank in ranks:
                    built[key] = group
        mine[kind] = built[key]
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
