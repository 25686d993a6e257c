"""The strategy's step methods at ``pp > 1`` (``loop.StepPath``): torch's schedule runs the micro-batches.

The user's ``training_step`` / ``validation_step`` / ``test_step`` are not called: the chunks and the module's loss
function run on the ranks that hold them (docs/pipeline.md, "With the strategy"); what the loss function logs is
replayed on every rank. The step's zeroing, gradient sync and log capture are the same :class:`StepHooks` the loop
uses at ``pp = 1``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from lightning_moe_overlap.accumulation import WHOLE, Window
from lightning_moe_overlap.loop import ContextFactory, StepHooks
from lightning_moe_overlap.loss.tokens import TokenScope
from lightning_moe_overlap.pipeline.pipelined import PipelinedModel
from lightning_moe_overlap.step_logs import MicroBatchLogs


class PipelinePath:
    """Training steps as the pipeline schedule (``hooks``: ``None`` outside ``fit``), evaluation as forwards only."""

    def __init__(
        self,
        pipeline: PipelinedModel,
        module: LightningModule,
        device: torch.device,
        hooks: StepHooks | None,
        train_context: ContextFactory,
        tokens: TokenScope | None = None,
        thread_ring: ContextFactory = nullcontext,
    ) -> None:
        self.pipeline = pipeline
        self.module = module
        self.device = device
        self.hooks = hooks
        self.train_context = _with(thread_ring, train_context)
        self.tokens = tokens  # the strategy's token count of the step (loss/tokens.py)
        self.thread_ring = thread_ring  # at cp > 1: the ring for the SDPA calls of the thread of each chunk forward

    def train(self, batch: Any, batch_idx: int, *rest: Any, window: Window = WHOLE) -> Tensor:
        hooks = self.hooks
        assert hooks is not None and self.tokens is not None, "PipelinePath.train outside fit"
        if window.first:
            hooks.zero_grad(batch_idx)
        logs = hooks.capture_logs()
        token_loss = None if hooks.token_loss is None else partial(hooks.token_loss, batch)
        with self.tokens.step(window.tokens, window.missing):
            result = self.pipeline.train_step(batch, logs, self.train_context, tokens=window.tokens,
                                              token_loss=token_loss, ends_step=window.last)  # fmt: skip
        if window.last:
            hooks.sync_gradients()
        logs.replay(result.logs)
        return result.loss

    def evaluate(self, user_step: Callable[..., Any], context: ContextFactory, batch: Any, batch_idx: int = 0,
                 *rest: Any, **kwargs: Any) -> Tensor:  # fmt: skip
        """The forwards of a validation / test batch; the mean loss on every rank."""
        logs = MicroBatchLogs(self.module)
        result = self.pipeline.eval_step(batch, logs, _with(self.thread_ring, context), self.device)
        logs.replay(result.logs)
        return result.loss

    def predict(self, user_step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"`MoEOverlapStrategy(pp={self.pipeline.config.pp})`: `Trainer.predict` with pipeline parallelism is not "
            "supported: the outputs live on the last stage's ranks only. Predict at pp=1 (load the checkpoint "
            "there: checkpoints are keyed by the unsplit model's names and load at any pp)."
        )


def _with(outer: ContextFactory, inner: ContextFactory) -> ContextFactory:
    """A context factory entering ``outer()`` then ``inner()``: what each chunk forward runs in, on its thread."""

    @contextmanager
    def both() -> Iterator[None]:
        with outer(), inner():
            yield

    return both
