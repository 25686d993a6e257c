"""The per-token mean of an optimizer step's loss, whatever its micro-batches and accumulated batches
(docs/overlap.md, "Which mean a step's loss is").

A supervised fine-tune labels some tokens only (``-100`` on prompts and padding), so its micro-batches hold unequal
numbers of labelled tokens, and the mean of the micro-batches' means is not the batch's loss (a micro-batch without
labels is even ``0 / 0``). The batch's loss is the sum over its labelled tokens divided by their count ``N``, and
that count is known before the first micro-batch runs: the strategy counts the step's labels (the batches of an
accumulation window, and with ``token_mean_over_dp`` every dp rank's), and a module's loss divides its micro-batch's
sum by it::

    loss = self.model(**batch, num_items_in_batch=step_tokens(self, batch)).loss   # Hugging Face models
    loss = F.cross_entropy(logits, labels, reduction="sum") / step_tokens(self, batch)  # any other

The strategy then back-propagates each micro-batch's loss as it is (a share of the step's mean, not divided by the
micro-batch count) and logs the batch's per-token mean. Outside the strategy's training step (plain Lightning,
validation, a model used on its own) :func:`step_tokens` is the count of ``batch`` itself, so the same line computes
the batch's own mean there.

What a token is: :func:`count_label_tokens`, the targets of Hugging Face's causal-LM loss (``labels`` shifted by one,
``-100`` ignored), or the LightningModule's ``count_loss_tokens(batch)`` where it defines one.

No global state: a :class:`TokenScope` belongs to one strategy and is found through the module's Trainer.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_moe_overlap._compat import lightning as pl_compat

IGNORE_INDEX = -100  # Hugging Face's label for "no loss here"
COUNT_HOOK = "count_loss_tokens"  # a LightningModule's own count: count_loss_tokens(batch) -> int or 0-dim tensor


def count_label_tokens(batch: Any) -> Tensor:
    """The tokens Hugging Face's causal-LM loss averages over in ``batch`` (an ``int64`` 0-dim tensor on the batch's
    device; no host read): with ``labels`` (a mapping's entry, ``[B, S]``) those of ``labels[:, 1:]`` that are not
    ``-100`` (position ``i`` predicts label ``i + 1``); without, ``B * (S - 1)`` of the token ids (a ``[B, S]``
    tensor, a tuple / list holding one, or a mapping's ``input_ids``).

    Raises:
        TypeError: a batch of another kind, naming the LightningModule hook that counts it.
    """
    if isinstance(batch, Mapping) and isinstance(batch.get("labels"), Tensor) and batch["labels"].dim() >= 2:
        return (batch["labels"][..., 1:] != IGNORE_INDEX).sum()
    tokens = batch.get("input_ids") if isinstance(batch, Mapping) else batch
    if isinstance(tokens, (tuple, list)) and len(tokens) == 1:
        tokens = tokens[0]
    if isinstance(tokens, Tensor) and tokens.dim() == 2:
        return torch.tensor(tokens.shape[0] * max(tokens.shape[1] - 1, 0), device=tokens.device)
    raise TypeError(
        f"`step_tokens`: cannot count the labelled tokens of a batch of type {type(batch).__name__}. Rule: the "
        "built-in count takes a dict with 'labels' (-100: no loss) or 'input_ids', or a [B, S] tensor of token ids. "
        f"Fix: give the LightningModule a `{COUNT_HOOK}(self, batch)` method returning the number of tokens its loss "
        "averages over in `batch`."
    )


def count_tokens_of(module: Any, batch: Any) -> Tensor:
    """``module.count_loss_tokens(batch)`` where the module defines it, else :func:`count_label_tokens`; a tensor."""
    hook = getattr(module, COUNT_HOOK, None)
    count = hook(batch) if callable(hook) else count_label_tokens(batch)
    return count if isinstance(count, Tensor) else torch.tensor(int(count))


@dataclass(frozen=True)
class StepTokens:
    """An accumulation window's token count, as the losses of its micro-batches divide by it.

    Attributes:
        divisor: what a micro-batch's token sum is divided by: the window's labelled tokens on this rank, or with
            ``token_mean_over_dp`` those of every dp rank divided by dp (the gradients are averaged over dp, so the
            ranks' shares add up to the global mean); at least 1 (a window without labels adds 0, never NaN).
        aux_weight: the weight of an auxiliary loss a micro-batch adds to its loss (``1 / (M * A)``: the routers'
            balancing loss keeps the micro-batch mean it has without token counting).
    """

    divisor: Tensor
    aux_weight: float


class TokenScope:
    """The strategy's token count of the current step (``None`` outside a training step) and how often the module
    asked for it (which tells the loop that a micro-batch's loss is a share of the step's mean). One per strategy;
    read by :func:`step_tokens` from the threads of the overlap engine, whose baton serialises them (so no lock, and
    the strategy that holds it pickles for the spawn launcher)."""

    def __init__(self) -> None:
        self.current: StepTokens | None = None
        self.missing: Exception | None = None  # why a training step has no count
        self.calls = 0
        self.warned = False

    @contextmanager
    def step(self, tokens: StepTokens | None, missing: Exception | None = None) -> Iterator[None]:
        """``tokens`` is the current count while a batch's micro-batches run; ``missing``: why there is none."""
        self.current, self.missing = tokens, missing
        try:
            yield
        finally:
            self.current = self.missing = None

    def take(self) -> StepTokens | None:
        """The current count, counting the call. Without one in a training step (the strategy could not count the
        batch: ``missing``), None, with a warning once: the module's loss is then each micro-batch's own mean."""
        if self.current is None and self.missing is not None and not self.warned:
            self.warned = True
            rank_zero_warn(
                f"`step_tokens`: the strategy could not count the tokens of the training batches ({self.missing}) "
                "so each micro-batch's loss is the mean over its own tokens and the step's the mean over the "
                "micro-batches, not the per-token mean of the step. Fix: give the LightningModule a "
                f"`{COUNT_HOOK}(self, batch)` method that counts a batch as the training dataloader yields it "
                "(docs/overlap.md, \"Which mean a step's loss is\").",
                category=UserWarning,
            )
        if self.current is not None:
            self.calls += 1
        return self.current


def scope_of(module: Any) -> TokenScope | None:
    """The :class:`TokenScope` of the strategy that trains ``module`` (None: no Trainer, or another strategy)."""
    trainer = pl_compat.attached_trainer(module)
    strategy = getattr(trainer, "strategy", None)
    scope = getattr(strategy, "token_scope", None)
    return scope if isinstance(scope, TokenScope) else None


def step_tokens(module: Any, batch: Any) -> Tensor:
    """What the loss of ``batch`` (a micro-batch of the step) divides its sum over tokens by, so that the step's loss
    is the per-token mean over every micro-batch (and accumulated batch, and with ``token_mean_over_dp`` dp rank).

    Inside ``MoEOverlapStrategy``'s training step: the window's count (:class:`StepTokens`); the strategy then
    back-propagates the loss unscaled and logs the batch's mean. Anywhere else: the count of ``batch`` itself, so the
    loss is the batch's own per-token mean. At least 1 either way. A float 0-dim tensor (``num_items_in_batch`` of a
    Hugging Face model's forward takes it)."""
    scope = scope_of(module)
    tokens = None if scope is None else scope.take()
    if tokens is not None:
        return tokens.divisor
    return count_tokens_of(module, batch).clamp(min=1).to(torch.float32)


def aux_loss_weight(module: Any) -> float:
    """The weight of an auxiliary loss (the routers' balancing loss) that a module adds to a loss divided by
    :func:`step_tokens`: ``1 / (M * A)`` in the strategy's training step (the micro-batch mean the strategy gives it
    otherwise), 1 anywhere else. Asking does not count as asking for the token count."""
    scope = scope_of(module)
    current = None if scope is None else scope.current
    return 1.0 if current is None else current.aux_weight
