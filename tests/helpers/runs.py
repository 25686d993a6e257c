"""Comparisons of the runs a distributed test's workers return: per rank ``{run name: {"losses": [...], "full": the
consolidated state on rank 0}}``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def assert_same_training(results: Sequence[dict], pairs: Iterable[tuple[str, str]]) -> None:
    """For each pair of run names: every rank's losses equal, and rank 0's consolidated states equal bitwise."""
    for a, b in pairs:
        for rank, runs in enumerate(results):
            assert runs[a]["losses"] == runs[b]["losses"], (rank, a, b)
        state_a, state_b = results[0][a]["full"], results[0][b]["full"]
        assert state_a.keys() == state_b.keys(), (a, b)
        for key, value in state_a.items():
            assert torch.equal(value, state_b[key]), (a, b, key)
