"""The loss function torch's schedule calls at ``pp > 1``: the model's own, weighted for the step.

torch's schedules divide every gradient by the micro-batch count after the step (``scale_grads``) when the losses are
micro-batch means; that divides gradients accumulated by earlier batches too, so with ``accumulate_grad_batches``
(and when the losses are shares of the step's per-token mean, ``loss/tokens.py``, which must not be divided) the
schedule is built with ``scale_grads=False`` and :class:`StepLoss` weighs each loss instead: by ``1 / (M * A)``
(means), or not at all (token shares). Which one is fixed before the step on every pp rank (only the last stage
calls the loss), by :attr:`PipelineChunks.token_loss`.

It also keeps the losses as the model's loss function returned them (what the step reports and logs), not those
the metadata inference of torch's first step computes; a loss over vocabulary-sharded logits (a replicated
``DTensor`` at ``tp > 1``) is kept as its plain value (``loss/vocab_parallel.py``).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_moe_overlap.loss.tokens import TokenScope
from lightning_moe_overlap.loss.vocab_parallel import plain_loss
from lightning_moe_overlap.pipeline.chunks import LossFn
from lightning_moe_overlap.step_logs import logs_are_paused


class StepLoss:
    """``loss_fn`` weighted by ``weight`` (None: unweighted; torch's schedule divides), its losses in :attr:`losses`.

    Raises (from a call): ``RuntimeError`` when ``loss_fn`` asks for ``step_tokens`` and ``token_loss`` was not
    declared, or declared and it does not ask."""

    def __init__(self, loss_fn: LossFn, tokens: TokenScope, *, token_loss: bool, weight: float | None) -> None:
        self.loss_fn = loss_fn
        self.tokens = tokens
        self.token_loss = token_loss
        self.weight = weight
        self.losses: list[Tensor] = []

    def __call__(self, output: Any, target: Any) -> Tensor:
        asked = self.tokens.calls
        loss = plain_loss(self.loss_fn(output, target))
        if logs_are_paused():  # torch's shape inference: no micro-batch's
            return loss
        if (self.tokens.calls != asked) != self.token_loss and self.tokens.current is not None:
            raise _undeclared(self.token_loss)
        self.losses.append(loss)
        # torch's split backward (zero-bubble, DualPipeV) detaches the loss in place, which a view refuses (the plain
        # value of a loss-parallel DTensor is one): the schedule gets a tensor of its own
        return loss.clone() if self.weight is None else loss * self.weight


def _undeclared(declared: bool) -> RuntimeError:
    did = "did not ask" if declared else "asked"
    return RuntimeError(
        f"`MoEOverlapStrategy` at pp > 1: the pipeline's loss function {did} for `step_tokens`, but its "
        f"`PipelineChunks(token_loss={declared})` says it {'does' if declared else 'does not'}. Rule: every pp rank "
        "must know before the step whether the losses are shares of the step's per-token mean (back-propagated as "
        "they are) or micro-batch means (weighted 1 / M). Fix: return `dataclasses.replace(chunks, token_loss=True)` "
        "from `configure_pipeline` when its loss function divides by `step_tokens`, and False otherwise."
    )
