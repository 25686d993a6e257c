"""Where the forward is, per thread: named regions, the core-attention call, and the stages of the local experts.

All of it is thread-local: with the overlap, the forward of one micro-batch and the backward (and recompute) of
another run in two threads, and each must see only its own regions.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_moe_overlap._compat import torch as torch_compat
from lightning_moe_overlap.moe.grouped import gated_activation
from lightning_moe_overlap.moe.layout import ExpertsLayout

_local = threading.local()

Around = Callable[[Callable[..., Any], tuple, dict], Any]


def active() -> Counter[str]:
    """Names of the regions this thread is inside (a count per name: regions may nest)."""
    counter = getattr(_local, "regions", None)
    if counter is None:
        counter = _local.regions = Counter()
    return counter


@contextmanager
def region(name: str) -> Iterator[None]:
    """Mark this thread as inside region ``name`` for the block."""
    counter = active()
    counter[name] += 1
    try:
        yield
    finally:
        counter[name] -= 1


def enter(name: str) -> None:
    active()[name] += 1


def leave(name: str) -> None:
    counter = active()
    if counter[name] > 0:
        counter[name] -= 1


def inside_checkpoint() -> bool:
    """True while a ``torch.utils.checkpoint`` forward or recomputation owns the saved tensors of this thread.

    Offload must not push its saved-tensor hooks there: the tensors are recomputed, not saved, and a hook pushed
    on top would take them from the checkpoint.
    """
    hooks = torch_compat.top_saved_tensors_hooks()
    return hooks is not None and getattr(hooks[0], "__module__", "") == "torch.utils.checkpoint"


class _CallInterceptor(TorchFunctionMode):
    """Runs ``around(func, args, kwargs)`` instead of each call of the functions in ``funcs``."""

    def __init__(self, funcs: frozenset[Callable[..., Any]], around: Around) -> None:
        super().__init__()
        self.funcs, self.around = funcs, around

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def, override]
        kwargs = kwargs or {}
        if func in self.funcs:  # the mode is off inside its own handler: `around` may call `func` directly
            return self.around(func, args, kwargs)
        return func(*args, **kwargs)


_SDPA = frozenset({F.scaled_dot_product_attention})


def around_sdpa(around: Around) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A wrapper factory for a module's ``forward``: its SDPA calls run through ``around``."""

    def wrap(forward: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            with _CallInterceptor(_SDPA, around):
                return forward(*args, **kwargs)

        return run

    return wrap


def in_region(name: str) -> Around:
    """An ``around`` that runs the call inside region ``name``."""

    def around(func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        with region(name):
            return func(*args, **kwargs)

    return around


def gate_of(layout: ExpertsLayout) -> Callable[[Tensor], Tensor]:
    """The activation stage of a layout as one function of the first projection's output (what grouped_mlp runs)."""
    if layout.gate_fn is not None:
        return layout.gate_fn
    act_fn = layout.act_fn
    if act_fn is None:
        raise ValueError("`gate_of`: the layout has neither gate_fn nor act_fn; it cannot compute the activation.")
    if layout.gated:
        return lambda h: gated_activation(h, act_fn)
    return act_fn


def wrap_gate(wrap: Callable[[Callable[[Tensor], Tensor]], Callable[[Tensor], Tensor]]) -> Callable[[Any], Any]:
    """A wrapper factory for an experts module's ``layout``: its activation stage becomes ``wrap(stage)``."""

    def on_layout(layout: ExpertsLayout) -> ExpertsLayout:
        return replace(layout, gate_fn=wrap(gate_of(layout)))

    return on_layout


class ExpertStages:
    """Marks the stages of the local experts: region ``fc1`` from the start of ``local_experts`` until the
    activation starts, region ``act`` during the activation (per thread and call; either name may be None)."""

    def __init__(self, fc1: str | None, act: str | None) -> None:
        self.fc1, self.act = fc1, act

    def local_experts(self, fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        fc1 = self.fc1

        def run(*args: Any, **kwargs: Any) -> Tensor:
            if fc1 is None:
                return fn(*args, **kwargs)
            stack = _fc1_stack()
            stack.append(True)
            enter(fc1)
            try:
                return fn(*args, **kwargs)
            finally:
                if stack.pop():
                    leave(fc1)

        return run

    def gate(self, fn: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
        fc1, act = self.fc1, self.act

        def run(h: Tensor) -> Tensor:
            stack = _fc1_stack()
            if fc1 is not None and stack and stack[-1]:  # the first projection is over
                stack[-1] = False
                leave(fc1)
            if act is None:
                return fn(h)
            with region(act):
                return fn(h)

        return run


def tagging(tag: Callable[[Tensor], None]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A wrapper factory for ``local_experts``: ``tag(rows)`` on the dispatched rows before the experts run."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(x_RD: Tensor, *args: Any, **kwargs: Any) -> Any:
            tag(x_RD)
            return fn(x_RD, *args, **kwargs)

        return run

    return wrap


def in_region_wrapper(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A wrapper factory: the wrapped function runs inside region ``name``."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            with region(name):
                return fn(*args, **kwargs)

        return run

    return wrap


def _fc1_stack() -> list[bool]:
    stack = getattr(_local, "fc1", None)
    if stack is None:
        stack = _local.fc1 = []
    return stack
