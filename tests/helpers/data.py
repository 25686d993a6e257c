"""Seeded random token sequences for the Trainer-level tests: one dataset instead of one per test module."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class RandomTokens(Dataset):
    """``n`` sequences of ``seq`` token ids below ``vocab``, drawn from ``seed`` (``.data``, ``[n, seq]``). A sample is
    the sequence, or ``(sequence, index)`` with ``indexed`` (for tests that record which samples a rank trained on)."""

    def __init__(self, n: int, seq: int, vocab: int, *, seed: int, indexed: bool = False) -> None:
        self.data = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))
        self.indexed = indexed

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        return (self.data[i], torch.tensor(i)) if self.indexed else self.data[i]
