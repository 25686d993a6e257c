"""One process training the unsplit model, as the distributed tests' oracle: no strategy code, only the model's own
loss and a torch optimizer."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn


def train_unsplit(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[Sequence[torch.Tensor]],
    micro: int,
    clip: float | None = None,
    after_step: Callable[[], None] | None = None,
) -> list[list[float]]:
    """``batches[s][d]``: dp rank ``d``'s batch of step ``s``. Per step, each of its ``micro`` micro-batches
    backpropagates ``model._loss(part) / (dp * micro)`` (the mean over the dp ranks and micro-batches), the gradients
    are clipped to ``clip`` by their global norm, the optimizer steps, then ``after_step()``. Returns each dp rank's
    per-step loss (the mean over its micro-batches, as each rank reports it)."""
    dp = len(batches[0])
    losses: list[list[float]] = [[] for _ in range(dp)]
    for step_batches in batches:
        optimizer.zero_grad()
        for d, batch in enumerate(step_batches):
            total = 0.0
            for part in batch.chunk(micro):
                loss = model._loss(part)
                (loss / (dp * micro)).backward()
                total += float(loss.detach()) / micro
            losses[d].append(total)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if after_step is not None:
            after_step()
    return losses
