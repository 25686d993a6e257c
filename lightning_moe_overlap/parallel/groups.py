"""This rank's process group of every parallel dimension, passed explicitly (never stored globally), and the
backend options of a kind's groups. The groups themselves are made in one place: the device mesh
(:func:`~lightning_moe_overlap.parallel.mesh.build_mesh`, then ``ParallelMesh.process_groups``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_moe_overlap.parallel.dims import ParallelDims, RankCoords


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's process group in each dimension, plus the sizes they were built from.

    ``dp_cp`` is the group dense gradients are averaged over; ``edp`` the one expert gradients are averaged over;
    ``ep`` the one tokens are exchanged in; ``dp_cp_tp`` (a pipeline stage) the one whose ranks see distinct tokens
    (with tensor parallelism each tp rank holds its own sequence shard), over which token counts are summed;
    ``cp_tp`` the ranks holding the parts of the same sequences (the routers' balancing loss counts over it). They
    are read off the one mesh of a run (``build_mesh(dims, device_type).process_groups(rank)``: each kind is its
    view's group).
    """

    dims: ParallelDims
    rank: int
    dp: ProcessGroup
    cp: ProcessGroup
    dp_cp: ProcessGroup
    tp: ProcessGroup
    cp_tp: ProcessGroup
    dp_cp_tp: ProcessGroup
    pp: ProcessGroup
    ep: ProcessGroup
    edp: ProcessGroup

    @property
    def coords(self) -> RankCoords:
        return self.dims.coords(self.rank)


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
