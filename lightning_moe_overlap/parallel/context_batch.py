"""The batch side of context parallelism: which tokens of a sequence each cp rank keeps, and back.

With causal attention the last tokens of a sequence attend to every earlier one and the first to almost none, so
cutting the sequence into ``cp`` contiguous pieces loads the last rank most. Torch's ring attention balances it
head-tail (its ``_HeadTailLoadBalancer``): the sequence is cut into ``2 * cp`` equal chunks and rank ``r`` keeps
chunks ``r`` and ``2 * cp - 1 - r``, in that order. Every per-token tensor of a micro-batch (input ids, labels,
position ids, a loss mask) is sharded the same way, so the tokens stay aligned; the rotary embedding must see each
kept token's global position (:func:`shard_positions`), not its index in the shard.

Labels are shifted for next-token prediction on the whole sequence, before sharding: a shift inside the model on
a shard would pair a token with its neighbour in the shard, which is not its successor at the chunk seams.

Shapes: ``T`` the sequence length, ``S = T / cp`` the tokens a rank keeps; the sequence dimension is ``seq_dim``
(1 for ``(batch, seq)`` token tensors).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor


def check_sequence(seq_len: int, cp: int, *, load_balance: bool = True) -> None:
    """Raise ``ValueError`` unless ``seq_len`` splits into the chunks of ``cp`` ranks (``2 * cp`` with
    ``load_balance``, ``cp`` without)."""
    if cp < 1:
        raise ValueError(f"cp={cp}: the context-parallel size is a positive number of ranks. Pass cp >= 1.")
    chunks = 2 * cp if load_balance else cp
    if seq_len % chunks:
        fit = -(-seq_len // chunks) * chunks
        how = f"2 x cp = {chunks} equal chunks (rank r keeps chunks r and {chunks - 1} - r)" if load_balance else (
            f"cp = {chunks} equal chunks"
        )
        raise ValueError(
            f"Sequence length {seq_len} is not divisible by {chunks} (cp={cp}, load_balance={load_balance}): context "
            f"parallelism cuts each sequence into {how}. Pad or cut the sequences to a multiple of {chunks} (for "
            f"example {fit}), or choose a cp for which {'2 x ' if load_balance else ''}cp divides {seq_len}."
        )


def _check_rank(rank: int, cp: int) -> None:
    if not 0 <= rank < cp:
        raise ValueError(f"cp rank {rank} is outside 0..{cp - 1} (cp={cp}). Pass the rank's index in the cp group.")


def shard_positions(seq_len: int, cp: int, rank: int, *, load_balance: bool = True, device=None) -> Tensor:
    """The global positions (``S`` int64) of the tokens cp rank ``rank`` keeps of a sequence of ``seq_len``."""
    check_sequence(seq_len, cp, load_balance=load_balance)
    _check_rank(rank, cp)
    if not load_balance:
        size = seq_len // cp
        return torch.arange(rank * size, (rank + 1) * size, device=device)
    size = seq_len // (2 * cp)
    head = torch.arange(rank * size, (rank + 1) * size, device=device)
    tail_chunk = 2 * cp - 1 - rank
    tail = torch.arange(tail_chunk * size, (tail_chunk + 1) * size, device=device)
    return torch.cat([head, tail])


def shard_sequence(tensor: Tensor, cp: int, rank: int, *, seq_dim: int = 1, load_balance: bool = True) -> Tensor:
    """The tokens of ``tensor`` (sequence on ``seq_dim``) that cp rank ``rank`` keeps, in the rank's order."""
    positions_S = shard_positions(tensor.size(seq_dim), cp, rank, load_balance=load_balance, device=tensor.device)
    return tensor.index_select(seq_dim, positions_S)


def shard_batch(
    cp: int,
    rank: int,
    *tensors_BT: Tensor | None,
    position_ids: Tensor | None = None,
    seq_dim: int = 1,
    load_balance: bool = True,
) -> tuple[tuple[Tensor | None, ...], Tensor]:
    """Shard a micro-batch's per-token tensors (input ids, shifted labels, ...; ``None`` passes through) for cp rank
    ``rank``, and their global position ids: ``position_ids`` sharded when given (packed documents), else the kept
    tokens' positions in the sequence, shaped ``(1, S)``. Returns ``(sharded tensors, position_ids)``."""
    present = [t for t in tensors_BT if t is not None]
    lengths = {t.size(seq_dim) for t in present} | ({position_ids.size(-1)} if position_ids is not None else set())
    if len(lengths) > 1:
        raise ValueError(
            f"shard_batch got per-token tensors of sequence lengths {sorted(lengths)}; every tensor of a micro-batch "
            "must cover the same tokens. Shift the labels on the whole sequence (keeping its length, padding the last "
            "label with the ignore index) before sharding."
        )
    if not lengths:
        raise ValueError("shard_batch got no tensor to shard. Pass the micro-batch's per-token tensors.")
    (seq_len,) = lengths
    sharded = tuple(
        None if t is None else shard_sequence(t, cp, rank, seq_dim=seq_dim, load_balance=load_balance)
        for t in tensors_BT
    )
    if position_ids is not None:
        return sharded, shard_sequence(position_ids, cp, rank, seq_dim=position_ids.ndim - 1, load_balance=load_balance)
    device = present[0].device
    return sharded, shard_positions(seq_len, cp, rank, load_balance=load_balance, device=device).unsqueeze(0)


def unshard_sequence(shards: Sequence[Tensor], *, seq_dim: int = 1, load_balance: bool = True) -> Tensor:
    """The whole sequence from every cp rank's shard (``shards[r]`` from rank ``r``): the inverse of
    :func:`shard_sequence`."""
    cp = len(shards)
    seq_len = sum(s.size(seq_dim) for s in shards)
    order_T = torch.cat([shard_positions(seq_len, cp, r, load_balance=load_balance) for r in range(cp)])
    stacked = torch.cat(list(shards), dim=seq_dim)
    inverse_T = torch.empty_like(order_T)
    inverse_T[order_T] = torch.arange(seq_len)
    return stacked.index_select(seq_dim, inverse_T.to(stacked.device))


def gather_sequence(
    shard: Tensor, group: dist.ProcessGroup, *, seq_dim: int = 1, load_balance: bool = True
) -> Tensor:
    """The whole sequence on every rank of the cp ``group``, from this rank's ``shard`` (an all-gather; not
    differentiable). For checks and tests."""
    cp = dist.get_world_size(group)
    shards = [torch.empty_like(shard) for _ in range(cp)]
    dist.all_gather(shards, shard.contiguous(), group=group)
    return unshard_sequence(shards, seq_dim=seq_dim, load_balance=load_balance)
