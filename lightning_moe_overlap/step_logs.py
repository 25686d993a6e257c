"""One logged value per optimizer step: the mean of what the micro-batches logged.

The user's ``training_step`` runs once per micro-batch and calls ``self.log(name, value)`` each time. Lightning
would keep the last call's value for ``on_step`` (and weigh the epoch mean by micro-batch), so while a step's
schedule runs :class:`MicroBatchLogs` collects the calls and, after the step, logs each name once with the mean of
its values and the last call's options (``prog_bar``, ``sync_dist``, ...).

Why an instance attribute. Lightning has no supported hook between ``LightningModule.log`` and its private result
collection (``Trainer._results``), and a callback sees the values only after they were stored. The capture therefore
shadows the module's ``log`` method with an instance attribute for the duration of the step (and removes it after,
also on error); this module is the only place that does it. Calls go to the capture from both contexts of the
overlapped schedule: they are serialised by the schedule's baton, and the order of the values is micro-batch order
(forwards run in micro-batch order).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from numbers import Number
from typing import Any

import torch
from torch import Tensor


class MicroBatchLogs:
    """Context manager: collects ``module.log`` calls while it is entered; :meth:`replay` logs their means."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.calls: dict[str, list[tuple[Any, tuple, dict]]] = {}

    def __enter__(self) -> MicroBatchLogs:
        self.module.log = self._capture  # an instance attribute shadows the method for the step
        return self

    def __exit__(self, *exc: object) -> None:
        del self.module.log

    def _capture(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if _PAUSED.depth:  # a forward that is not a micro-batch's (torch's pipeline metadata inference)
            return
        self.calls.setdefault(name, []).append((value, args, kwargs))

    def summary(self, loss_of: tuple[list[Any], Tensor] | None = None) -> list[tuple[str, Any, tuple, dict]]:
        """``(name, mean of its values, last call's args, last call's kwargs)`` per captured name, in first-call order
        (at ``pp > 1`` the last stage's summary is sent to the other ranks of its pipeline).

        ``loss_of``: ``(the micro-batches' losses or step outputs, the batch's loss)``: a name logged once per
        micro-batch with that micro-batch's loss tensor (the same storage: ``loss``, ``loss.detach()``) is logged as
        the batch's loss instead of the mean (``loss/tokens.py``: there each micro-batch's loss is its share of the
        step's per-token mean, whose mean over the micro-batches is no loss)."""
        out = []
        for name, calls in self.calls.items():
            values = [value for value, _, _ in calls]
            value = loss_of[1] if loss_of is not None and _are_losses(values, loss_of[0]) else mean_of(values)
            _, args, kwargs = calls[-1]
            out.append((name, value, args, kwargs))
        return out

    def replay(
        self,
        summary: list[tuple[str, Any, tuple, dict]] | None = None,
        *,
        loss_of: tuple[list[Any], Tensor] | None = None,
    ) -> None:
        """Log each captured name once, through the module's own ``log``, with :func:`mean_of` its values (or the
        entries of ``summary``, e.g. another rank's; ``loss_of``: see :meth:`summary`)."""
        for name, value, args, kwargs in self.summary(loss_of) if summary is None else summary:
            self.module.log(name, value, *args, **kwargs)


class _PausedState(threading.local):
    """Per thread, i.e. per execution context: the open :func:`logs_paused` scopes."""

    depth = 0


_PAUSED = _PausedState()


@contextmanager
def logs_paused() -> Iterator[None]:
    """``self.log`` calls made inside, on this thread, are dropped by the capture: at the first step (and after each
    switch between evaluation and training) torch's pipeline schedules run every stage's forward and the loss
    function once more to infer shapes, on uninitialised tensors after stage 0; that loss is no micro-batch's."""
    _PAUSED.depth += 1
    try:
        yield
    finally:
        _PAUSED.depth -= 1


def logs_are_paused() -> bool:
    """Whether this thread is inside :func:`logs_paused` (a forward that is not a micro-batch's)."""
    return _PAUSED.depth > 0


def _are_losses(values: list[Any], outputs: list[Any]) -> bool:
    """Whether ``values[i]`` is micro-batch ``i``'s loss (a step output: a tensor, or a mapping with ``"loss"``),
    for every ``i`` (compared by storage: no value is read)."""
    if len(values) != len(outputs):
        return False
    for value, output in zip(values, outputs, strict=True):
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if not (isinstance(value, Tensor) and isinstance(loss, Tensor) and value.shape == loss.shape):
            return False
        if value.untyped_storage().data_ptr() != loss.untyped_storage().data_ptr():
            return False
    return True


def mean_of(values: list[Any]) -> Any:
    """Mean of tensors/numbers (a metric object, which accumulates itself, is passed on as the last value)."""
    if not all(isinstance(v, (Tensor, Number)) for v in values):
        return values[-1]
    if len(values) == 1:
        return values[0]
    stacked = torch.stack([torch.as_tensor(v).detach().to(torch.float64).reshape(()) for v in values])
    mean = stacked.mean()
    first = values[0]
    return mean.to(first.dtype if isinstance(first, Tensor) and first.is_floating_point() else torch.float32)
