"""Plain tensors and ``DTensor``s side by side: the local shard of either, and a local shard wrapped like a parameter.

Expert parameters are ``DTensor``s sharded over the ep mesh (``moe/ep.py``) and, under ``fully_shard``, every
parameter is one (``parallelize/sharding.py``); the kernels, collectives and norms of this package work on the local
shards, which is what :func:`local` gives for both kinds.
"""

from __future__ import annotations

from torch import Tensor
from torch.distributed.tensor import DTensor


def local(tensor: Tensor) -> Tensor:
    """The shard this rank holds: ``tensor.to_local()`` for a ``DTensor`` (differentiable), ``tensor`` otherwise."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def like(reference: Tensor, local_shard: Tensor) -> Tensor:
    """``local_shard`` as ``reference`` holds it: a ``DTensor`` with its mesh, placements and global shape when
    ``reference`` is one, ``local_shard`` itself otherwise (no communication)."""
    if not isinstance(reference, DTensor):
        return local_shard
    return DTensor.from_local(
        local_shard,
        reference.device_mesh,
        reference.placements,
        run_check=False,
        shape=reference.shape,
        stride=reference.stride(),
    )
