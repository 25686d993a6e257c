"""Wrappers stacked on one attribute of one object (a module's ``forward``, an experts module's ``layout``).

The memory callbacks change how a sub-module runs without touching the model's code: they replace the bound
attribute on the instance by a wrapper of it. Several callbacks may wrap the same attribute, and they are removed
in whatever order Lightning tears them down, so each attribute keeps its stack of wrappers and rebuilds the
instance attribute from the original value whenever one is added or removed.

Wrappers are applied innermost first by ``order``: region markers and function interceptors (``INNER``) sit
closest to the original, checkpoints (``CHECKPOINT``) around them, layer units (``UNIT``) outermost. That keeps a
recomputation identical to the forward: a checkpoint re-runs everything inside it, markers included.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

INNER = 0
CHECKPOINT = 10
UNIT = 20

_STATE_ATTR = "_memory_callback_patches"
_counter = itertools.count()


@dataclass
class _Stack:
    had_instance_value: bool
    base: Any
    wrappers: list[tuple[int, int, Callable[[Any], Any]]] = field(default_factory=list)


class PatchHandle:
    """Removes one wrapper; the attribute is rebuilt from the original and the remaining wrappers."""

    def __init__(self, obj: Any, attr: str, key: int) -> None:
        self.obj, self.attr, self.key = obj, attr, key

    def remove(self) -> None:
        stacks: dict[str, _Stack] = vars(self.obj).get(_STATE_ATTR, {})
        stack = stacks.get(self.attr)
        if stack is None:
            return
        stack.wrappers = [w for w in stack.wrappers if w[1] != self.key]
        _rebuild(self.obj, self.attr, stack)
        if not stack.wrappers:
            del stacks[self.attr]
            if not stacks:
                del vars(self.obj)[_STATE_ATTR]


def patch(obj: Any, attr: str, wrap: Callable[[Any], Any], *, order: int) -> PatchHandle:
    """Replace ``obj.<attr>`` by ``wrap(current value)``, stacked by ``order``; returns a handle to undo it."""
    stacks: dict[str, _Stack] = vars(obj).setdefault(_STATE_ATTR, {})
    stack = stacks.get(attr)
    if stack is None:
        had = attr in vars(obj)
        stack = _Stack(had_instance_value=had, base=vars(obj)[attr] if had else None)
        stacks[attr] = stack
    key = next(_counter)
    stack.wrappers.append((order, key, wrap))
    stack.wrappers.sort(key=lambda w: (w[0], w[1]))
    _rebuild(obj, attr, stack)
    return PatchHandle(obj, attr, key)


def _rebuild(obj: Any, attr: str, stack: _Stack) -> None:
    if not stack.wrappers:
        if stack.had_instance_value:
            object.__setattr__(obj, attr, stack.base)
        else:
            vars(obj).pop(attr, None)
        return
    if stack.had_instance_value:
        value = stack.base
    else:
        vars(obj).pop(attr, None)
        value = getattr(obj, attr)  # the class attribute, bound to the instance
    for _, _, wrap in stack.wrappers:
        value = wrap(value)
    object.__setattr__(obj, attr, value)
