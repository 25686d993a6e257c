"""Move experts between ranks: the rows of every tensor that follows an experts module's slots, in one exchange.

A re-placement (``moe/placement.py``) changes which slot holds which logical expert. Every tensor whose dim 0 is
the slots must follow: the experts' parameters, their gradients, and the optimizer's per-parameter state of the
same shape (Adam's moments). Each is a ``DTensor`` split along dim 0 over its mesh (``Shard(0)`` over ep; under
``fully_shard`` also over edp), so :func:`~lightning_moe_overlap._compat.torch.row_owners` says which rank holds
which rows, on every rank without communication, and each rank works out the same plan: for every new slot, the
rank and row its expert comes from.

The exchange is point to point: one send and one receive per peer and dtype, the rows of every layer and tensor
packed in one order both sides derive (layers in model order, tensors in the order given, new slots ascending).
Rows that stay on their rank are copied locally; nothing else moves. Every tensor is then rewritten in place
(``copy_``), so the optimizer, the module and any view of them keep their tensors.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_moe_overlap._compat import torch as torch_compat
from lightning_moe_overlap.moe.placement import ExpertPlacement

Key = tuple[int, torch.dtype]  # (peer rank, dtype): one buffer each way


@dataclass(frozen=True)
class LayerMove:
    """The tensors of one experts module (dim 0: its slots) and the placement they go from and to."""

    tensors: Sequence[Tensor]
    before: ExpertPlacement
    after: ExpertPlacement


@dataclass(frozen=True)
class MoveReport:
    """What this rank's part of a move did: rows and bytes sent to other ranks, and the wall time."""

    rows_sent: int
    bytes_sent: int
    seconds: float


@dataclass
class _Plan:
    """One tensor's part: local copies ``new[dst] = old[src]``, rows to send (by peer), rows to receive (by peer)."""

    tensor: Tensor  # this rank's rows
    keep_dst: list[int]
    keep_src: list[int]
    send: dict[int, list[int]]  # peer -> local rows, in the order the peer receives them
    receive: dict[int, list[int]]  # peer -> local rows they fill, in the same order


def move_rows(moves: Sequence[LayerMove]) -> MoveReport:
    """Rewrite each move's tensors from its ``before`` to its ``after`` placement (collective among the ranks that
    hold the tensors: each must call it with the same layers and tensors, in the same order).

    Raises:
        NotImplementedError: a tensor is not split along dim 0 only, or some rows are held by two ranks.
    """
    start = time.perf_counter()
    me = dist.get_rank() if dist.is_initialized() else 0
    plans = [_plan(t, m.before, m.after, me) for m in moves if m.before != m.after for t in m.tensors]
    plans = [p for p in plans if p.send or p.receive or p.keep_dst != p.keep_src]
    outgoing: dict[Key, list[Tensor]] = defaultdict(list)
    sizes: dict[Key, int] = defaultdict(int)
    for plan in plans:
        rows = plan.tensor
        for peer, local_rows in plan.send.items():
            outgoing[peer, rows.dtype].append(rows[local_rows].reshape(-1))
        for peer, local_rows in plan.receive.items():
            sizes[peer, rows.dtype] += len(local_rows) * math.prod(rows.shape[1:])
    device = plans[0].tensor.device if plans else torch.device("cpu")
    sent = {key: torch.cat(parts) for key, parts in outgoing.items()}
    received = _exchange(sent, sizes, device)
    offsets: dict[Key, int] = defaultdict(int)
    with torch.no_grad():
        for plan in plans:
            _rewrite(plan, received, offsets)
    rows_sent = sum(len(r) for plan in plans for r in plan.send.values())
    bytes_sent = sum(buf.numel() * buf.element_size() for buf in sent.values())
    return MoveReport(rows_sent=rows_sent, bytes_sent=bytes_sent, seconds=time.perf_counter() - start)


def _exchange(sent: dict[Key, Tensor], sizes: dict[Key, int], device: torch.device) -> dict[Key, Tensor]:
    """One send and one receive per (peer, dtype), all at once; the received buffers by (peer, dtype)."""
    received = {key: torch.empty(n, dtype=key[1], device=device) for key, n in sorted(sizes.items(), key=_order)}
    ops = [dist.P2POp(dist.isend, buf, peer) for (peer, _), buf in sorted(sent.items(), key=_order)]
    ops += [dist.P2POp(dist.irecv, buf, peer) for (peer, _), buf in received.items()]
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return received


def _order(item: tuple[Key, object]) -> tuple[int, str]:
    (peer, dtype), _ = item
    return peer, str(dtype)


@dataclass(frozen=True)
class RowTransfer:
    """Row ``src_row`` of ``src`` on rank ``src_rank`` into row ``dst_row`` of ``dst`` on rank ``dst_rank`` (each
    tensor given on the rank that holds it, ``None`` elsewhere)."""

    src_rank: int
    src: Tensor | None
    src_row: int
    dst_rank: int
    dst: Tensor | None
    dst_row: int


def transfer_rows(transfers: Sequence[RowTransfer], *, accumulate: bool = False) -> int:
    """Copy (``accumulate``: add) rows between ranks in one exchange; the bytes this rank sent. Every rank passes
    the same transfers in the same order (the order rows are packed and, when adding, summed in). Collective among
    the ranks named."""
    me = dist.get_rank() if dist.is_initialized() else 0
    outgoing: dict[Key, list[Tensor]] = defaultdict(list)
    sizes: dict[Key, int] = defaultdict(int)
    device = torch.device("cpu")
    for t in transfers:
        if t.src_rank == me and t.dst_rank != me:
            assert t.src is not None
            outgoing[t.dst_rank, t.src.dtype].append(t.src[t.src_row].reshape(-1))
            device = t.src.device
        elif t.dst_rank == me and t.src_rank != me:
            assert t.dst is not None
            sizes[t.src_rank, t.dst.dtype] += math.prod(t.dst.shape[1:])
            device = t.dst.device
    sent = {key: torch.cat(parts) for key, parts in outgoing.items()}
    received = _exchange(sent, sizes, device)
    offsets: dict[Key, int] = defaultdict(int)
    with torch.no_grad():
        for t in transfers:
            if t.dst_rank != me:
                continue
            assert t.dst is not None
            if t.src_rank == me:
                assert t.src is not None
                row = t.src[t.src_row]
            else:
                key, width = (t.src_rank, t.dst.dtype), math.prod(t.dst.shape[1:])
                row = received[key][offsets[key] : offsets[key] + width].view(t.dst.shape[1:])
                offsets[key] += width
            if accumulate:
                t.dst[t.dst_row] += row
            else:
                t.dst[t.dst_row] = row
    return sum(buf.numel() * buf.element_size() for buf in sent.values())


def _plan(tensor: Tensor, before: ExpertPlacement, after: ExpertPlacement, me: int) -> _Plan:
    num = before.num_experts
    owners = _owners(tensor, me)
    if len(owners) != num or tensor.shape[0] != num:
        raise NotImplementedError(
            f"`move_rows`: a tensor of {tensor.shape[0]} rows is held as {len(owners)} rows across its ranks, for "
            f"{num} slots; every slot's row must be held by exactly one rank of the tensor's mesh (no `Replicate` "
            "placement). Split the experts' tensors along dim 0 only."
        )
    slot_before = before.slot_of()
    rows = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    plan = _Plan(rows, [], [], defaultdict(list), defaultdict(list))
    for new_slot in range(num):  # ascending: the order both sides of an exchange use
        old_slot = slot_before[after.experts[new_slot]]
        (dst_rank, dst_row), (src_rank, src_row) = owners[new_slot], owners[old_slot]
        if dst_rank == me and src_rank == me:
            plan.keep_dst.append(dst_row)
            plan.keep_src.append(src_row)
        elif dst_rank == me:
            plan.receive[src_rank].append(dst_row)
        elif src_rank == me:
            plan.send[dst_rank].append(src_row)
    return plan


def _owners(tensor: Tensor, me: int) -> list[tuple[int, int]]:
    """``(rank, local row)`` of each global row, in row order (one entry per rank that holds it)."""
    if not isinstance(tensor, DTensor):
        return [(me, row) for row in range(tensor.shape[0])]
    held = [(first + row, rank, row) for rank, first, count in torch_compat.row_owners(tensor) for row in range(count)]
    return [(rank, row) for _, rank, row in sorted(held)]


def _rewrite(plan: _Plan, received: dict[Key, Tensor], offsets: dict[Key, int]) -> None:
    rows = plan.tensor
    new = torch.empty_like(rows)
    if plan.keep_dst:
        new[plan.keep_dst] = rows[plan.keep_src]
    width = math.prod(rows.shape[1:])
    for peer, local_rows in plan.receive.items():
        key = (peer, rows.dtype)
        start, count = offsets[key], len(local_rows) * width
        new[local_rows] = received[key][start : start + count].view(len(local_rows), *rows.shape[1:])
        offsets[key] = start + count
    rows.copy_(new)
