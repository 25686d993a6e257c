"""The micro-batch step inside Lightning's automatic optimization (the NeMo ``_skip_backward`` pattern).

Lightning still builds the closure and calls ``optimizer_step``, so callbacks, gradient clipping, LR schedulers,
``global_step``, logging, checkpointing and the progress bar keep working. Inside the closure,
``strategy.training_step`` runs the whole step: zero grads, split the batch, run the schedule (the user's own
``training_step`` is the forward of each micro-batch; ``strategy.backward`` fires ``on_before_backward`` /
``on_after_backward`` per micro-batch), average gradients over the data-parallel groups, and return the mean loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from numbers import Number
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch import Trainer
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_moe_overlap.overlap.engine import OverlapEngine

if TYPE_CHECKING:
    from lightning_moe_overlap.strategy import MoEOverlapStrategy


def split_batch(batch: Any, num_microbatches: int) -> list[Any]:
    """Split every tensor of ``batch`` evenly along dim 0; other leaves are shared by all micro-batches.

    Raises:
        ValueError: no tensor has a batch dimension, or a batch dimension is not a multiple of the count.
    """
    if num_microbatches == 1:
        return [batch]
    sizes: set[int] = set()
    apply_to_collection(batch, Tensor, lambda t: sizes.add(t.shape[0]) if t.dim() > 0 else None)
    if not sizes:
        raise ValueError(
            f"`MoEOverlapStrategy`: `num_microbatches={num_microbatches}` but the batch holds no tensor with a batch "
            "dimension to split. Return tensors from the dataloader, or set `num_microbatches=1`."
        )
    bad = sorted(n for n in sizes if n % num_microbatches)
    if bad:
        raise ValueError(
            f"`MoEOverlapStrategy`: a batch dimension of {bad[0]} does not split into "
            f"`num_microbatches={num_microbatches}` equal micro-batches; every tensor's first dimension must be a "
            f"multiple of it. Use a batch size that is a multiple of {num_microbatches} (and `drop_last=True`), "
            "or change `num_microbatches`."
        )

    def part(i: int) -> Any:
        def take(t: Tensor) -> Tensor:
            if t.dim() == 0:
                return t
            size = t.shape[0] // num_microbatches
            return t[i * size : (i + 1) * size]

        return apply_to_collection(batch, Tensor, take)

    return [part(i) for i in range(num_microbatches)]


def _loss_of(output: Any) -> Tensor:
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, Tensor):
        raise TypeError(
            "`MoEOverlapStrategy`: `training_step` must return a loss tensor or a dict with a 'loss' tensor; got "
            f"{type(output).__name__}. Returning None to skip a step is not supported in distributed training."
        )
    return loss


class _LogCapture:
    """Collects ``self.log`` calls made by the micro-batches and logs each name once, with the step's mean."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.calls: dict[str, list[tuple[Any, tuple, dict]]] = {}

    def __enter__(self) -> _LogCapture:
        self.module.log = self._capture  # an instance attribute shadows the method for the step
        return self

    def __exit__(self, *exc: object) -> None:
        del self.module.log

    def _capture(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        self.calls.setdefault(name, []).append((value, args, kwargs))

    def replay(self) -> None:
        for name, calls in self.calls.items():
            values = [value for value, _, _ in calls]
            _, args, kwargs = calls[-1]
            self.module.log(name, _mean(values), *args, **kwargs)


def _mean(values: list[Any]) -> Any:
    """Mean of tensors/numbers (a metric object, which accumulates itself, is passed on as the last value)."""
    if not all(isinstance(v, (Tensor, Number)) for v in values):
        return values[-1]
    if len(values) == 1:
        return values[0]
    stacked = torch.stack([torch.as_tensor(v).detach().to(torch.float64).reshape(()) for v in values])
    mean = stacked.mean()
    first = values[0]
    return mean.to(first.dtype if isinstance(first, Tensor) and first.is_floating_point() else torch.float32)


class MicroBatchLoop:
    """Owned by the strategy during ``fit``: installs itself into Lightning's loop and runs each step."""

    def __init__(self, strategy: MoEOverlapStrategy, trainer: Trainer, engine: OverlapEngine) -> None:
        self.strategy = strategy
        self.trainer = trainer
        self.engine = engine
        self._auto = trainer.fit_loop.epoch_loop.automatic_optimization

    def install(self) -> None:
        self._auto._skip_backward = True

    def uninstall(self) -> None:
        self._auto._skip_backward = False

    def step(self, batch: Any, batch_idx: int, *rest: Any) -> Any:
        strategy, config = self.strategy, self.strategy.config
        module = strategy.lightning_module
        optimizer = self.trainer.optimizers[0]
        count = config.num_microbatches
        self._auto._on_before_zero_grad(optimizer)
        self._auto._optimizer_zero_grad(batch_idx, optimizer)
        micro = split_batch(batch, count)
        outputs: list[Any] = [None] * count

        def forward(i: int) -> Tensor:
            with strategy.precision_plugin.train_step_context():
                outputs[i] = module.training_step(micro[i], batch_idx, *rest)
            return _loss_of(outputs[i])

        def backward(i: int, loss: Tensor) -> None:
            strategy.backward(loss / count, optimizer)

        with _LogCapture(module) as logs:
            losses = self.engine.run(forward, backward, count)
        strategy.sync_gradients()
        logs.replay()
        return _step_output(outputs, losses)


def _step_output(outputs: list[Any], losses: list[Tensor]) -> Any:
    """What Lightning sees: the mean loss (detached: backward already ran) plus the last micro-batch's extras."""
    loss = torch.stack([l.detach().float() for l in losses]).mean()
    last = outputs[-1]
    if isinstance(last, Mapping):
        extras = {k: (v.detach() if isinstance(v, Tensor) else v) for k, v in last.items() if k != "loss"}
        return {"loss": loss, **extras}
    return loss

