"""Wrappers stacked on a module's ``forward``, for what no hook can do on the model's own modules.

Forward hooks run before and after a module's forward but cannot run the forward itself in another way; two things
the memory callbacks need do exactly that on the user's modules: run a module's forward as a checkpoint
(``SelectiveRecompute`` on ``attn``, the norms, whole layers) and intercept a function call inside it (the core
attention is a ``scaled_dot_product_attention`` call, not a module). The alternatives are module surgery (a wrapper
module in the parent, which renames the state-dict keys) or a private torch API, so the wrapper replaces the bound
``forward`` on the instance and is removed at teardown. The experts need none of this: their stages are modules
that take wrappers through a documented API (``experts.stage(name).add_wrapper``, see ``moe/stages.py``).

Several callbacks may wrap the same ``forward``, and they are removed in whatever order Lightning tears them down,
so each module keeps its stack of wrappers and rebuilds ``forward`` from the original whenever one is added or
removed. Wrappers are applied innermost first by ``order``: call interceptors (``INNER``) sit closest to the
original, checkpoints (``CHECKPOINT``) around them, layer units (``UNIT``) outermost. That keeps a recomputation
identical to the forward: a checkpoint re-runs everything inside it, interceptors included.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

INNER = 0
CHECKPOINT = 10
UNIT = 20

Forward = Callable[..., Any]

_STATE_ATTR = "_memory_callback_forwards"
_counter = itertools.count()


@dataclass
class _Stack:
    had_instance_value: bool
    base: Any
    wrappers: list[tuple[int, int, Callable[[Forward], Forward]]] = field(default_factory=list)


class PatchHandle:
    """Removes one wrapper; ``forward`` is rebuilt from the original and the remaining wrappers."""

    def __init__(self, module: nn.Module, key: int) -> None:
        self.module, self.key = module, key

    def remove(self) -> None:
        stack: _Stack | None = vars(self.module).get(_STATE_ATTR)
        if stack is None:
            return
        stack.wrappers = [w for w in stack.wrappers if w[1] != self.key]
        _rebuild(self.module, stack)
        if not stack.wrappers:
            del vars(self.module)[_STATE_ATTR]


def wrap_forward(module: nn.Module, wrap: Callable[[Forward], Forward], *, order: int) -> PatchHandle:
    """Replace ``module.forward`` by ``wrap(current forward)``, stacked by ``order``; returns a handle to undo it."""
    state = vars(module)
    stack: _Stack | None = state.get(_STATE_ATTR)
    if stack is None:
        had = "forward" in state
        stack = _Stack(had_instance_value=had, base=state["forward"] if had else None)
        object.__setattr__(module, _STATE_ATTR, stack)
    key = next(_counter)
    stack.wrappers.append((order, key, wrap))
    stack.wrappers.sort(key=lambda w: (w[0], w[1]))
    _rebuild(module, stack)
    return PatchHandle(module, key)


def _rebuild(module: nn.Module, stack: _Stack) -> None:
    state = vars(module)
    if not stack.wrappers:
        if stack.had_instance_value:
            object.__setattr__(module, "forward", stack.base)
        else:
            state.pop("forward", None)
        return
    if stack.had_instance_value:
        value = stack.base
    else:
        state.pop("forward", None)
        value = module.forward  # the class's forward, bound to the instance
    for _, _, wrap in stack.wrappers:
        value = wrap(value)
    object.__setattr__(module, "forward", value)
