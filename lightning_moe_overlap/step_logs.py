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
from collections.abc import Iterator
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

    def summary(self) -> list[tuple[str, Any, tuple, dict]]:
        """``(name, mean of its values, last call's args, last call's kwargs)`` per captured name, in first-call order
        (at ``pp > 1`` the last stage's summary is sent to the other ranks of its pipeline)."""
        out = []
        for name, calls in self.calls.items():
            value = mean_of([value for value, _, _ in calls])
            _, args, kwargs = calls[-1]
            out.append((name, value, args, kwargs))
        return out

    def replay(self, summary: list[tuple[str, Any, tuple, dict]] | None = None) -> None:
        """Log each captured name once, through the module's own ``log``, with :func:`mean_of` its values (or the
        entries of ``summary``, e.g. another rank's)."""
        for name, value, args, kwargs in self.summary() if summary is None else summary:
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
