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


def correction_bias_steps(model: nn.Module, rate: float) -> Callable[[], None]:
    """For an HF DeepSeek-V3 model (``model.model.model.layers[i].mlp.gate.e_score_correction_bias``): hooks that count
    each gate's routed experts, and the ``after_step`` that moves every correction bias by
    ``rate * sign(mean - count)`` from the step's counts (DeepSeek-V3's rule), then clears the counts. Any other
    model: a step that does nothing."""
    inner = getattr(getattr(model, "model", None), "model", None)
    gates = [layer.mlp.gate for layer in getattr(inner, "layers", [])
             if hasattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias")]  # fmt: skip
    counts = [torch.zeros(g.e_score_correction_bias.numel(), dtype=torch.int64) for g in gates]

    def counter(count: torch.Tensor):
        def hook(gate, args, output) -> None:  # output: (logits, weights, chosen experts)
            count.add_(torch.bincount(output[2].flatten(), minlength=len(count)))

        return hook

    for gate, count in zip(gates, counts):
        gate.register_forward_hook(counter(count))

    def update_biases() -> None:
        with torch.no_grad():
            for gate, count in zip(gates, counts):
                gate.e_score_correction_bias.add_(torch.sign(count.double().mean() - count.double()).float() * rate)
                count.zero_()

    return update_biases
