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


def head_inputs(
    dtype: torch.dtype = torch.float32, *, tokens: int, hidden: int, rows: int, bias: bool = True, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """``(hidden [tokens, hidden], weight [rows, hidden], bias [rows] or None, target [tokens])`` of an LM head's
    loss in ``dtype``, the tensors requiring gradients; every 4th target is ``-100`` (ignored)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(rows, hidden, generator=g) * 0.5).to(dtype).requires_grad_()
    b = (torch.randn(rows, generator=g) * 0.1).to(dtype).requires_grad_() if bias else None
    target = torch.randint(0, rows, (tokens,), generator=g)
    target[::4] = -100
    return h, w, b, target
