"""The batch side of context parallelism: head-tail shards, global positions, and back.

Oracles: the chunks each rank keeps written out by hand (rank r keeps chunks r and 2cp-1-r of 2cp), and the
round trip shard -> unshard giving the original tensor back.
"""

from __future__ import annotations

import pytest
import torch

from lightning_moe_overlap.parallel.context_batch import (
    check_sequence,
    shard_batch,
    shard_positions,
    shard_sequence,
    unshard_sequence,
)


def test_head_tail_positions_written_out() -> None:
    # T=8, cp=2: chunks of 2 -> rank 0 keeps chunks 0 and 3, rank 1 chunks 1 and 2
    assert shard_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert shard_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    # T=16, cp=4: chunks of 2
    assert [shard_positions(16, 4, r).tolist() for r in range(4)] == [
        [0, 1, 14, 15],
        [2, 3, 12, 13],
        [4, 5, 10, 11],
        [6, 7, 8, 9],
    ]


def test_contiguous_positions_without_load_balance() -> None:
    assert [shard_positions(6, 3, r, load_balance=False).tolist() for r in range(3)] == [[0, 1], [2, 3], [4, 5]]


def test_shards_cover_the_sequence_once() -> None:
    for cp in (1, 2, 3, 4):
        seq = 4 * cp * 3
        kept = torch.cat([shard_positions(seq, cp, r) for r in range(cp)])
        assert sorted(kept.tolist()) == list(range(seq))


def test_shard_sequence_takes_the_positions_on_any_dim() -> None:
    x_BHTD = torch.arange(2 * 3 * 8 * 2).view(2, 3, 8, 2)
    got = shard_sequence(x_BHTD, 2, 1, seq_dim=2)
    assert torch.equal(got, x_BHTD[:, :, [2, 3, 4, 5]])


@pytest.mark.parametrize("load_balance", [True, False])
def test_unshard_inverts_shard(load_balance: bool) -> None:
    x_BT = torch.randn(3, 24)
    shards = [shard_sequence(x_BT, 3, r, load_balance=load_balance) for r in range(3)]
    assert torch.equal(unshard_sequence(shards, load_balance=load_balance), x_BT)


def test_shard_batch_keeps_tokens_aligned_and_gives_global_positions() -> None:
    ids_BT = torch.arange(16).view(2, 8)
    labels_BT = ids_BT + 100
    (ids, labels, none), positions = shard_batch(2, 1, ids_BT, labels_BT, None)
    assert ids.tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert torch.equal(labels, ids + 100) and none is None
    assert positions.tolist() == [[2, 3, 4, 5]]


def test_shard_batch_shards_given_position_ids() -> None:
    ids_BT = torch.zeros(1, 8, dtype=torch.long)
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])  # two documents
    _, positions = shard_batch(2, 0, ids_BT, position_ids=packed)
    assert positions.tolist() == [[0, 1, 3, 4]]


def test_sequence_not_divisible_by_2cp_is_refused() -> None:
    rule = r"Sequence length 10 is not divisible by 4 \(cp=2.*chunks r and 3 - r.*multiple of 4 \(for example 12\)"
    with pytest.raises(ValueError, match=rule):
        check_sequence(10, 2)
    with pytest.raises(ValueError, match="not divisible by 4"):
        shard_batch(2, 0, torch.zeros(1, 10))
    check_sequence(10, 2, load_balance=False)  # contiguous shards need only cp | T
    with pytest.raises(ValueError, match=r"not divisible by 3 \(cp=3, load_balance=False\)"):
        check_sequence(10, 3, load_balance=False)


def test_bad_cp_and_rank_are_refused() -> None:
    with pytest.raises(ValueError, match="cp=0: the context-parallel size"):
        check_sequence(8, 0)
    with pytest.raises(ValueError, match=r"cp rank 2 is outside 0..1 \(cp=2\)"):
        shard_positions(8, 2, 2)


def test_shard_batch_refuses_misaligned_or_missing_tensors() -> None:
    with pytest.raises(ValueError, match=r"sequence lengths \[7, 8\].*Shift the labels on the whole sequence"):
        shard_batch(2, 0, torch.zeros(1, 8), torch.zeros(1, 7))
    with pytest.raises(ValueError, match="got no tensor to shard"):
        shard_batch(2, 0, None)
