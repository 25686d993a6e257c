"""One optimizer step as a micro-batch schedule, from narrow inputs: :class:`StepHooks` and an :class:`Executor`.

Inside Lightning's automatic optimization with backward skipped (the NeMo ``_skip_backward`` pattern), Lightning
still builds the closure and calls ``optimizer_step``, so callbacks, gradient clipping, LR schedulers,
``global_step``, logging, checkpointing and the progress bar keep working; the closure's training step is
:meth:`MicroBatchLoop.step`. It knows nothing of Lightning's loop or of ``MoEOverlapStrategy``, which builds the
hooks from itself and installs the step.

A step, as phases::

    hooks.zero_grad(batch_idx)                    # on_before_zero_grad, optimizer_zero_grad
    micro = split_batch(batch, M, short=True)     # every tensor split evenly along dim 0 (a short batch: nearly)
    with hooks.capture_logs() as logs:            # self.log calls of the M training steps
        losses = executor.run(forward, backward, M)
    hooks.sync_gradients()                        # once, after the last backward (which hooks.before_last_backward
                                                  # precedes, e.g. to reduce gradients as they become final)
    logs.replay()                                 # each name once, the mean over the micro-batches
    return mean loss (+ the last micro-batch's extra outputs)

where ``forward(i) = loss of hooks.forward(micro[i], batch_idx, ...)`` and
``backward(i, loss) = hooks.backward(loss / M)``. A short batch (an epoch's last one, ``N`` rows that ``M`` does not
divide) runs as ``min(N, M)`` parts of ``n_i`` rows, each loss weighted by ``n_i / N`` (the routers' auxiliary
losses too, through ``hooks.aux_loss_scale``), so its gradient is that of the mean loss over the batch.

The executor contract (``run(forward, backward, count) -> losses``):

- ``forward(i)`` returns micro-batch ``i``'s loss; ``backward(i, loss)`` back-propagates it. The executor calls
  each exactly once per micro-batch, ``forward(i)`` before ``backward(i, ...)``, and the backwards in micro-batch
  order (the order gradients accumulate in, which keeps any two executors bitwise comparable);
- it returns the ``count`` losses in micro-batch order; it may run tasks on other threads, but returns (or raises
  the first error) on the calling thread once every task has ended;
- it owns everything between the hooks: interleaving (the :class:`~lightning_moe_overlap.overlap.OverlapEngine`
  pairs ``F[i+1]`` with ``B[i]`` around the all-to-alls), thread-local state, failure detection.

The owner's step methods (training, validation, test, predict) run through a :class:`StepPath`: :class:`LoopPath`
here at ``pp = 1`` (training through this loop, evaluation as the user's own steps on gathered parameters),
``PipelinePath`` (``pipeline/path.py``) at ``pp > 1``, where torch's schedule owns the micro-batches and the user's
steps are not called. Both take the same :class:`StepHooks`, so zeroing, gradient sync and the logging of a step are
one code path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_moe_overlap.accumulation import WHOLE, Window
from lightning_moe_overlap.loss.tokens import TokenScope
from lightning_moe_overlap._checks import same_on_every_rank
from lightning_moe_overlap.step_logs import MicroBatchLogs

ContextFactory = Callable[[], AbstractContextManager]


class Executor(Protocol):
    """Runs one step's forwards and backwards of ``count`` micro-batches (contract in the module docstring)."""

    def run(
        self, forward: Callable[[int], Tensor], backward: Callable[[int, Tensor], None], count: int
    ) -> list[Tensor]: ...


@dataclass(frozen=True)
class StepHooks:
    """What a step needs from its owner, as callables (``MoEOverlapStrategy`` builds them once per ``fit``).

    Attributes:
        zero_grad: ``(batch_idx)``: before the first forward; Lightning's ``on_before_zero_grad`` and
            ``optimizer_zero_grad``.
        forward: ``(micro_batch, batch_idx, *rest) -> output``: the user's ``training_step`` on one micro-batch,
            under the precision plugin's train-step context; the output is a loss tensor or a dict with ``"loss"``.
        backward: ``(loss)``: back-propagate one micro-batch's loss, already divided by the micro-batch count
            (fires ``on_before_backward`` / ``on_after_backward``).
        sync_gradients: ``()``: once after the last backward: average gradients over the data-parallel groups.
        capture_logs: ``()`` -> a fresh :class:`~lightning_moe_overlap.step_logs.MicroBatchLogs` for the step.
        aux_loss_scale: ``(scale)``: the weight of the routers' auxiliary losses in the next forwards (``1 / M``
            for ``M`` equal micro-batches; a short batch's parts are weighted by their rows); None: not needed.
        before_last_backward: ``()``: just before the step's last backward, which every executor runs alone (after
            every other task has ended), in the thread that runs it; e.g. to issue gradient reductions during it.
            None: not needed.
        token_loss: ``(batch, token_sum) -> loss``: a batch's loss as logged when its micro-batches' losses were
            divided by the window's token count (``loss/tokens.py``): ``token_sum`` (the batch's summed token losses
            on this rank) over the batch's tokens (over dp with ``token_mean_over_dp``). None: not needed.
    """

    zero_grad: Callable[[int], None]
    forward: Callable[..., Any]
    backward: Callable[[Tensor], None]
    sync_gradients: Callable[[], None]
    capture_logs: Callable[[], MicroBatchLogs]
    aux_loss_scale: Callable[[float], None] | None = None
    before_last_backward: Callable[[], None] | None = None
    token_loss: Callable[[Any, Tensor], Tensor] | None = None


class MicroBatchLoop:
    """Runs each optimizer step as ``num_microbatches`` micro-batches through ``executor``."""

    def __init__(
        self, hooks: StepHooks, executor: Executor, num_microbatches: int, tokens: TokenScope | None = None
    ) -> None:
        assert num_microbatches >= 1, num_microbatches  # validated with the configuration
        self.hooks = hooks
        self.executor = executor
        self.num_microbatches = num_microbatches
        self.tokens = TokenScope() if tokens is None else tokens

    def step(self, batch: Any, batch_idx: int, *rest: Any, window: Window = WHOLE) -> Any:
        hooks = self.hooks
        if window.first:
            hooks.zero_grad(batch_idx)
        micro = split_batch(batch, self.num_microbatches, short=True)
        count = len(micro)
        # A full batch: M equal parts, each loss / M. A short one (an epoch's last batch): parts weighted by rows.
        # Accumulated batches: each also / A. A loss divided by the step's tokens (`step_tokens`): as it is.
        weights = _row_weights(micro)
        share = [1.0 / count if weights is None else w for w in (weights or [0.0] * count)]
        rescale = hooks.aux_loss_scale
        if rescale is not None and weights is None and count == self.num_microbatches and window.batches == 1:
            rescale = None  # the weight set at setup (1 / M) holds
        outputs: list[Any] = [None] * count
        per_token = [False] * count

        def forward(i: int) -> Tensor:
            if rescale is not None:
                rescale(share[i] / window.batches)
            asked = self.tokens.calls
            outputs[i] = hooks.forward(micro[i], batch_idx, *rest)
            per_token[i] = self.tokens.calls != asked
            return _loss_of(outputs[i])

        def backward(i: int, loss: Tensor) -> None:
            if i == count - 1 and window.last and hooks.before_last_backward is not None:
                hooks.before_last_backward()
            if per_token[i] != per_token[0]:
                raise _mixed_token_counts(per_token[: i + 1])
            if per_token[i]:
                hooks.backward(loss)  # already its share of the window's per-token mean
            elif weights is None:
                hooks.backward(loss / (count * window.batches))
            else:
                hooks.backward(loss * (weights[i] / window.batches))

        try:
            with hooks.capture_logs() as logs, self.tokens.step(window.tokens, window.missing):
                losses = self.executor.run(forward, backward, count)
        finally:
            if rescale is not None:
                rescale(1.0 / self.num_microbatches)
        if window.last:
            hooks.sync_gradients()
        if all(per_token) and window.tokens is not None and hooks.token_loss is not None:
            step_sum = torch.stack([l.detach().float() for l in losses]).sum() * window.tokens.divisor
            loss = hooks.token_loss(batch, step_sum)
            logs.replay(loss_of=(outputs, loss))
            return _step_output(outputs, losses, loss=loss)
        logs.replay()
        return _step_output(outputs, losses, weights)


def _mixed_token_counts(asked: list[bool]) -> RuntimeError:
    return RuntimeError(
        f"`MoEOverlapStrategy`: the training step asked for `step_tokens` in some micro-batches of a step and not in "
        f"others (micro-batches {[i for i, a in enumerate(asked) if a]} of {len(asked)} so far asked). Rule: a loss "
        "divided by `step_tokens` is back-propagated as it is, any other divided by the micro-batch count, so every "
        "micro-batch's loss must be of one kind. Fix: call `step_tokens(self, batch)` in every training step, or in "
        "none."
    )


class StepPath(Protocol):
    """How the owner's step methods run (one object per setup, so those methods have no ``pp`` branch).

    ``train(batch, batch_idx, *rest, window=)``: one batch's forwards and backwards, the loss Lightning sees; ``window``
    (``accumulation.py``) says whether it starts (zeroes) and ends (reduces) an accumulation window.
    ``evaluate(user_step, context, *args, **kwargs)``: a validation / test step; ``user_step`` is the
    LightningModule's own step (through Lightning), ``context`` the precision plugin's step context.
    ``predict(user_step, *args, **kwargs)``: a prediction step.
    """

    def train(self, batch: Any, batch_idx: int, *rest: Any, window: Window = WHOLE) -> Any: ...

    def evaluate(self, user_step: Callable[..., Any], context: ContextFactory, *args: Any, **kwargs: Any) -> Any: ...

    def predict(self, user_step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any: ...


class LoopPath:
    """``pp = 1``: training through :class:`MicroBatchLoop` (``loop``; ``None`` outside ``fit``), evaluation and
    prediction as the user's own steps after ``gather()`` (``fully_shard`` keeps the parameters sharded at rest;
    ``ShardedModel.gather`` does nothing when they already are gathered, and is collective over the shard groups)."""

    def __init__(self, gather: Callable[[], None], loop: MicroBatchLoop | None) -> None:
        self.gather = gather
        self.loop = loop

    def train(self, batch: Any, batch_idx: int, *rest: Any, window: Window = WHOLE) -> Any:
        assert self.loop is not None, "LoopPath.train outside fit"
        return self.loop.step(batch, batch_idx, *rest, window=window)

    def evaluate(self, user_step: Callable[..., Any], context: ContextFactory, *args: Any, **kwargs: Any) -> Any:
        self.gather()
        return user_step(*args, **kwargs)  # Lightning's own step method enters the precision context itself

    def predict(self, user_step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.gather()
        return user_step(*args, **kwargs)


def split_batch(batch: Any, num_microbatches: int, *, short: bool = False) -> list[Any]:
    """Split every tensor of ``batch`` evenly along dim 0; other leaves are shared by all micro-batches.

    With ``short=True`` a batch of ``N`` rows that ``num_microbatches`` does not divide (an epoch's last batch
    without ``drop_last``) is split as ``torch.tensor_split`` does: ``min(N, M)`` parts whose rows differ by at most
    one (every tensor must then have the same ``N``).

    Raises:
        ValueError: no tensor has a batch dimension, or a batch dimension is not a multiple of the count; marked
            :func:`~.parallel.exits.same_on_every_rank` (every rank's batches come from the same loader settings),
            so the launcher shows it once.
    """
    if num_microbatches == 1:
        return [batch]
    sizes: set[int] = set()
    apply_to_collection(batch, Tensor, lambda t: sizes.add(t.shape[0]) if t.dim() > 0 else None)
    if not sizes:
        raise same_on_every_rank(ValueError(
            f"`MoEOverlapStrategy`: `num_microbatches={num_microbatches}` but the batch holds no tensor with a batch "
            "dimension to split. Return tensors from the dataloader, or set `num_microbatches=1`."
        ))
    bad = sorted(n for n in sizes if n % num_microbatches)
    if bad and short and len(sizes) == 1 and bad[0] > 0:
        parts = min(bad[0], num_microbatches)
        return [apply_to_collection(batch, Tensor, lambda t, i=i: _part(t, parts, i)) for i in range(parts)]
    if bad:
        raise same_on_every_rank(ValueError(
            f"`MoEOverlapStrategy`: a batch dimension of {bad[0]} does not split into "
            f"`num_microbatches={num_microbatches}` equal micro-batches; every tensor's first dimension must be a "
            f"multiple of it. Use a batch size that is a multiple of {num_microbatches} (and `drop_last=True`), "
            "or change `num_microbatches`."
        ))

    def part(i: int) -> Any:
        def take(t: Tensor) -> Tensor:
            if t.dim() == 0:
                return t
            size = t.shape[0] // num_microbatches
            return t[i * size : (i + 1) * size]

        return apply_to_collection(batch, Tensor, take)

    return [part(i) for i in range(num_microbatches)]


def _part(t: Tensor, parts: int, i: int) -> Tensor:
    return t if t.dim() == 0 else torch.tensor_split(t, parts)[i]


def _rows(part: Any) -> int:
    rows: list[int] = []
    apply_to_collection(part, Tensor, lambda t: rows.append(t.shape[0]) if t.dim() > 0 else None)
    return rows[0] if rows else 0


def _row_weights(micro: list[Any]) -> list[float] | None:
    """Each part's share of the batch's rows, or None when the parts are equal (then each loss is divided by the
    count, as a mean over equal parts is)."""
    rows = [_rows(part) for part in micro]
    if len(set(rows)) <= 1:
        return None
    total = sum(rows)
    return [n / total for n in rows]


def _loss_of(output: Any) -> Tensor:
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, Tensor):
        raise TypeError(
            "`MoEOverlapStrategy`: `training_step` must return a loss tensor or a dict with a 'loss' tensor; got "
            f"{type(output).__name__}. Returning None to skip a step is not supported in distributed training."
        )
    return loss


def _step_output(
    outputs: list[Any], losses: list[Tensor], weights: list[float] | None = None, *, loss: Tensor | None = None
) -> Any:
    """What Lightning sees: ``loss``, or the mean loss (weighted by rows for a short batch; detached: backward already
    ran), plus the last micro-batch's extras."""
    if loss is None:
        stacked = torch.stack([l.detach().float() for l in losses])
        loss = stacked.mean() if weights is None else (stacked * torch.tensor(weights)).sum()
    last = outputs[-1]
    if isinstance(last, Mapping):
        extras = {k: (v.detach() if isinstance(v, Tensor) else v) for k, v in last.items() if k != "loss"}
        return {"loss": loss, **extras}
    return loss
