"""Gradient synchronisation over the data-parallel groups and clipping by the true global norm.

Scaling. Each rank backpropagates ``loss / num_microbatches`` of its own batch. The global objective is the mean
over the ``D = dp * cp`` data-parallel ranks, so

- a dense parameter is replicated on every rank of the ``dp_cp`` group: its gradient is summed over ``dp_cp`` and
  divided by ``D`` (by ``fully_shard``: ``parallelize/sharding.py``);
- an expert parameter is replicated only over the ``edp`` group, but its local gradient already holds the
  contributions of every rank of its ``ep`` group (their tokens came to it through the all-to-all). Summing over
  ``edp`` therefore covers all ``D`` ranks, and it is divided by ``D`` as well, not by ``edp``.

With sharded parameters (``shard="optimizer"`` / ``"full"``, ``parallelize/sharding.py``) FSDP reduce-scatters the
gradients instead.

Norm. After the sync every gradient is a local shard or a replica: dense gradients are equal on every rank of a pp
stage (``"none"``) or split over it (sharded), expert gradients split over ep (and edp when sharded), and each pp
rank holds other chunks. :func:`global_grad_norm` weights each local shard's squares by the inverse of its number
of copies, read from its ``DTensor`` placements, and sums over the world in one all-reduce.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from lightning_moe_overlap._compat import torch as torch_compat
from lightning_moe_overlap.parallel.dtensors import local

_BUCKET_BYTES = 64 << 20


def materialised_grads(params: Iterable[torch.nn.Parameter]) -> list[Tensor]:
    """The local shards of the gradients of ``params``; a missing one becomes zeros so every rank reduces the same
    buffers."""
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(local(p.grad))
    return grads


def _buckets(tensors: Sequence[Tensor]) -> Iterable[list[Tensor]]:
    """Consecutive runs of same-dtype tensors of at most ``_BUCKET_BYTES`` (order is identical on every rank)."""
    bucket: list[Tensor] = []
    size = 0
    for t in tensors:
        if bucket and (t.dtype != bucket[0].dtype or size + t.numel() * t.element_size() > _BUCKET_BYTES):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += t.numel() * t.element_size()
    if bucket:
        yield bucket


def allreduce_mean(grads: Sequence[Tensor], group: ProcessGroup, divisor: int) -> None:
    """In place: ``g = sum_over_group(g) / divisor``, bucketed into flat buffers."""
    if dist.get_world_size(group) == 1 and divisor == 1:
        return
    for bucket in _buckets(grads):
        in_place = len(bucket) == 1 and bucket[0].is_contiguous()  # one tensor: reduced through a flat view of it
        flat = bucket[0].view(-1) if in_place else torch.cat([g.reshape(-1) for g in bucket])
        if dist.get_world_size(group) > 1:
            dist.all_reduce(flat, group=group)
        flat.div_(divisor)
        if not in_place:
            for g, synced in zip(bucket, flat.split([g.numel() for g in bucket])):
                g.copy_(synced.view_as(g))


def sync_gradients(
    dense: Sequence[torch.nn.Parameter],
    expert: Sequence[torch.nn.Parameter],
    *,
    dp_cp_group: ProcessGroup,
    edp_group: ProcessGroup,
    dp_cp_size: int,
) -> None:
    """Average dense gradients over ``dp_cp`` and expert gradients over ``edp``, both scaled by ``1/dp_cp_size``
    (for the layers used without the strategy, whose dense gradients go through ``fully_shard`` instead)."""
    allreduce_mean(materialised_grads(dense), dp_cp_group, dp_cp_size)
    sync_expert_gradients(expert, edp_group=edp_group, dp_cp_size=dp_cp_size)


def sync_expert_gradients(expert: Sequence[torch.nn.Parameter], *, edp_group: ProcessGroup, dp_cp_size: int) -> None:
    """Average expert gradients over ``edp``, scaled by ``1/dp_cp_size`` (the dense ones go through FSDP:
    ``parallelize/sharding.py``)."""
    allreduce_mean(materialised_grads(expert), edp_group, dp_cp_size)


def _by_device_and_dtype(grads: Iterable[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    return groups


def _present_grads(params: Iterable[torch.nn.Parameter]) -> list[Tensor]:
    """The local shards of the gradients that exist."""
    return [local(p.grad.detach()) for p in params if p.grad is not None]


# -- the global norm: one reduction over the world, whatever the gradients' layout -----------------------------------
def _copies(grad: Tensor, block: int) -> int:
    """On how many ranks of a ``block``-rank model replica (one pp stage) each element of ``grad`` lives: a plain
    tensor on all of them, a ``DTensor`` on ``block`` / (the size of the mesh dimensions it is sharded over)."""
    if not isinstance(grad, DTensor):
        return block
    mesh = grad.device_mesh
    shards = math.prod(mesh.size(i) for i, placement in enumerate(grad.placements) if not placement.is_replicate())
    return block // shards


def global_grad_norm(
    params: Iterable[torch.nn.Parameter], *, block: int, group: ProcessGroup | None = None, device: torch.device
) -> Tensor:
    """The L2 norm of the gradients of ``params`` over every rank of ``group`` (default: the world), a float64
    scalar on ``device``, identical everywhere.

    Gradients may be plain tensors (replicated over the ``block`` ranks that hold one copy of the model, i.e. one pp
    stage), DTensors of expert parallelism (``Shard(0)`` over ep) or of ``fully_shard`` (over ``dp_cp``, or
    ``(edp, ep)`` for experts). Each rank adds the squares of its local shards (one fused ``torch._foreach_norm``
    per device, dtype and weight, in float64, as ``torch.nn.utils.clip_grad_norm_`` does), each weighted by
    ``1 / copies`` so an element counts once over its replicas, and ONE all-reduce over ``group`` sums them; no host
    sync.
    """
    grads: dict[tuple[torch.device, torch.dtype, int], list[Tensor]] = {}
    for p in params:
        if p.grad is None:
            continue
        grad = p.grad.detach()
        shard = local(grad)
        grads.setdefault((shard.device, shard.dtype, _copies(grad, block)), []).append(shard)
    partials = [
        torch.stack(torch_compat.foreach_norm(locals_, 2.0, dtype=torch.float64)).square().sum().to(device) / copies
        for (_, _, copies), locals_ in grads.items()
    ]
    total_sq = torch.stack(partials).sum() if partials else torch.zeros((), dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(total_sq, group=group)
    return total_sq.sqrt()


def clip_grad_norm(
    params: Sequence[torch.nn.Parameter],
    max_norm: float,
    *,
    block: int,
    group: ProcessGroup | None = None,
    eps: float = 1e-6,
    device: torch.device,
) -> Tensor:
    """Scale every gradient by ``min(1, max_norm / (norm + eps))`` like ``torch.nn.utils.clip_grad_norm_``, the norm
    being :func:`global_grad_norm`'s: one ``foreach`` multiply per (device, dtype) of the local shards, the
    coefficient applied on the device (``clamp``, no ``if``), so clipping never waits for the device. Returns the
    norm before clipping (a float64 tensor on ``device``)."""
    norm = global_grad_norm(params, block=block, group=group, device=device)
    coef = torch.clamp(max_norm / (norm + eps), max=1.0)
    for (grad_device, dtype), grads in _by_device_and_dtype(_present_grads(params)).items():
        torch_compat.foreach_mul_(grads, coef.to(grad_device, dtype))
    return norm


# -- loss scaling: one verdict on an overflow for the whole world ------------------------------------------------
def agree_found_inf(flags: Sequence[Tensor], *, group: ProcessGroup | None = None) -> None:
    """Set each of ``flags`` (a ``GradScaler``'s found-inf flags of one optimizer, one per device) to the largest
    flag of any rank of ``group`` (default: the world). Collective: every rank calls it once per optimizer step.

    ``GradScaler`` checks each rank's local gradient shards; on ``DTensor`` s torch reduces the flag only over the
    mesh of the first gradient, and never across pp stages. An overflow in one rank's experts would then skip the
    step on that rank only, and replicated weights and loss scales would drift apart. After this every rank skips
    together. No host sync (``GradScaler.step`` reads the flag itself).
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    if flags:
        device = flags[0].device
    else:  # nothing was checked here (no gradient on this rank): still take part in the reduction
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    any_inf = torch.zeros((), dtype=torch.float32, device=device)
    for flag in flags:
        any_inf = torch.maximum(any_inf, flag.detach().reshape(()).to(any_inf.device, torch.float32))
    dist.all_reduce(any_inf, op=dist.ReduceOp.MAX, group=group)
    for flag in flags:
        flag.copy_(any_inf.reshape(flag.shape))
