"""Where the forward is, per thread: named regions and the core-attention call.

All of it is thread-local: with the overlap, the forward of one micro-batch and the backward (and recompute) of
another run in two threads, and each must see only its own regions. A module (a stage of the experts included,
``experts.stage(name)``) is marked with its forward pre-hook and forward hook (:func:`enter`, :func:`leave`); the
core attention is a function call inside a module, marked by intercepting that call (:func:`around_sdpa`).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lightning_moe_overlap._compat.torch import top_saved_tensors_hooks

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
    hooks = top_saved_tensors_hooks()
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
