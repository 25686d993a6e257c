"""Lightning's ``accumulate_grad_batches`` under the strategy: where a batch sits in its accumulation window, and the
window's token count (docs/overlap.md, "Gradient accumulation").

With ``Trainer(accumulate_grad_batches=A)`` Lightning calls the strategy's training step once per batch and its
optimizer step after every ``A``-th batch (and the epoch's last). The strategy runs each batch's micro-batches as
usual and, from the :class:`Window` of the batch: zeroes the gradients at the window's first batch only, scales
each loss by ``1 / A`` as Lightning does (the routers' auxiliary losses too), and reduces the gradients once, after
the window's last backward (FSDP's reduce-scatter or all-reduce, the experts' over edp, the tp sums): as many
gradient reductions per optimizer step as without accumulation.

The per-token mean of a window (``loss/tokens.py``) needs the labelled tokens of its later batches before its first
micro-batch runs. :class:`LookaheadLoader` (the strategy's ``process_dataloader`` wraps the training dataloader in
it when ``A > 1``) reads ``A - 1`` batches ahead of the one Lightning trains on, as Hugging Face's Trainer reads an
accumulation window's batches before its first step; the strategy counts their tokens on the batches as the loader
yields them (before Lightning's ``transfer_batch_to_device`` and ``on_after_batch_transfer`` hooks).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_moe_overlap._compat import lightning as pl_compat
from lightning_moe_overlap.config import OverlapConfig
from lightning_moe_overlap.loss.tokens import StepTokens, count_tokens_of


@dataclass(frozen=True)
class Window:
    """Where a training batch sits in its accumulation window.

    Attributes:
        first: the window's first batch: the gradients are zeroed before it.
        last: the window's last batch: the gradients are reduced after it and the optimizer steps.
        batches: Lightning's ``accumulate_grad_batches``: each batch's mean loss weighs ``1 / batches`` (Lightning
            divides by it at an epoch's short last window too).
        tokens: the window's token count (``loss/tokens.py``); None where the batches could not be counted.
        missing: why they could not: raised when the module asks for the count (``step_tokens``).
    """

    first: bool = True
    last: bool = True
    batches: int = 1
    tokens: StepTokens | None = None
    missing: Exception | None = None


WHOLE = Window()  # a step without accumulation


class LookaheadLoader:
    """A training dataloader read ``ahead`` batches in advance: :meth:`upcoming` gives the batches after the one the
    strategy trains on. Iterates, measures (``len``) and otherwise behaves as the wrapped loader (its ``sampler``,
    ``batch_size``, ``dataset``, ... are read through, and written through: Lightning sets ``worker_init_fn``)."""

    def __init__(self, loader: Any, ahead: int) -> None:
        object.__setattr__(self, "loader", loader)
        object.__setattr__(self, "ahead", ahead)
        # read from the loader and not yet trained on, oldest first: the batch in training comes first once the
        # strategy has called `consume`, then those Lightning fetched early and those read ahead
        object.__setattr__(self, "_unconsumed", deque())
        object.__setattr__(self, "_training", False)  # the oldest unconsumed batch is in training

    def __iter__(self) -> Iterator[Any]:
        self._unconsumed.clear()
        object.__setattr__(self, "_training", False)
        return self._read(iter(self.loader))

    def _read(self, source: Iterator[Any]) -> Iterator[Any]:
        read: deque[Any] = deque()  # read ahead, not yet yielded
        exhausted = False
        while True:
            while not exhausted and len(read) <= self.ahead:
                try:
                    batch = next(source)
                except StopIteration:
                    exhausted = True
                    break
                read.append(batch)
                self._unconsumed.append(batch)
            if not read:
                return
            yield read.popleft()

    def begin_step(self) -> None:
        """A training step starts on the next batch read (Lightning trains on the batches in the order read): the
        previous one is done."""
        if self._training and self._unconsumed:
            self._unconsumed.popleft()
        object.__setattr__(self, "_training", True)

    def upcoming(self, count: int) -> list[Any]:
        """Up to ``count`` batches after the one in training (fewer at the end of the loader)."""
        return list(self._unconsumed)[1 : 1 + count]

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "loader"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.loader, name, value)


class Accumulation:
    """The windows of one ``fit``: ``batches`` is Lightning's ``accumulate_grad_batches``; ``module`` counts the
    tokens (``loss/tokens.py``); ``dp_group`` the ranks whose counts add up with ``config.token_mean_over_dp``."""

    def __init__(
        self, batches: int, module: Any, config: OverlapConfig, *, dp_group: Any, device: torch.device
    ) -> None:
        self.batches = batches
        self.module = module
        self.num_microbatches = config.num_microbatches
        self.over_dp = config.token_mean_over_dp
        self.dp_group = dp_group
        self.device = device
        self.loader: LookaheadLoader | None = None
        self._tokens: StepTokens | None = None  # the current window's
        self._missing: Exception | None = None
        self._counts: list[Tensor] = []  # the labelled tokens of the window's batches, counted at its first
        self._position = 0  # the current batch's place in its window

    def read_ahead(self, dataloader: Any) -> LookaheadLoader:
        """``dataloader`` read ``batches - 1`` batches ahead (the strategy's ``process_dataloader``)."""
        self.loader = LookaheadLoader(dataloader, self.batches - 1)
        return self.loader

    def window(self, trainer: Any, batch: Any, batch_idx: int) -> Window:
        """The window of the training batch ``batch`` (``batch_idx`` in its epoch), counting its tokens at its first
        batch (with ``token_mean_over_dp`` one all-reduce over dp, on every rank of the group alike)."""
        if self.loader is not None:
            self.loader.begin_step()
        self._position = batch_idx % self.batches
        first = self._position == 0
        last = self.batches == 1 or not pl_compat.should_accumulate(trainer)
        if first:
            self._count(trainer, batch, batch_idx)
        return Window(first, last, self.batches, self._tokens, self._missing)

    def _count(self, trainer: Any, batch: Any, batch_idx: int) -> None:
        later: list[Any] = []
        self._counts = []
        if self.batches > 1:
            size = min(self.batches, trainer.num_training_batches - batch_idx)
            if self.loader is None:
                self._tokens, self._missing = None, _no_lookahead(self.batches)
                return
            later = self.loader.upcoming(int(size) - 1 if math.isfinite(size) else self.batches - 1)
        try:
            counts = [count_tokens_of(self.module, b) for b in (batch, *later)]
        except TypeError as err:
            self._tokens, self._missing = None, err
            return
        self._counts = [c.to(self.device, torch.float32).reshape(()) for c in counts]
        total = torch.stack(self._counts).sum()
        ranks = 1
        if self.over_dp and dist.get_world_size(self.dp_group) > 1:
            dist.all_reduce(total, group=self.dp_group)
            ranks = dist.get_world_size(self.dp_group)
        aux_weight = 1.0 / (self.num_microbatches * self.batches)
        self._tokens, self._missing = StepTokens(total.clamp(min=1) / ranks, aux_weight), None

    def batch_loss(self, batch: Any, token_sum: Tensor) -> Tensor:
        """A batch's loss as logged and returned, from ``token_sum`` (its micro-batches' token losses summed on this
        rank): over its own labelled tokens, or with ``token_mean_over_dp`` the sum and the count of every dp rank
        (one all-reduce); 0 for a batch without labels."""
        if self._position < len(self._counts):  # counted with the window
            count = self._counts[self._position].to(token_sum.device)
        else:
            count = count_tokens_of(self.module, batch).to(token_sum.device, torch.float32).reshape(())
        if self.over_dp and dist.get_world_size(self.dp_group) > 1:
            both = torch.stack([token_sum.float(), count])
            dist.all_reduce(both, group=self.dp_group)
            token_sum, count = both[0], both[1]
        return token_sum / count.clamp(min=1)


def _no_lookahead(batches: int) -> RuntimeError:
    return RuntimeError(
        f"with `accumulate_grad_batches={batches}` a window's later batches are read ahead from the training "
        "dataloader Lightning hands the strategy, and this run's batches did not come from one"
    )
