"""Full recompute of consecutive decoder layers as one checkpoint unit (Megatron's ``--recompute-method uniform``).

A unit of one layer is a plain checkpoint of the layer. For a unit of ``n > 1`` layers only the input of its first
layer (the *anchor*) may stay alive, although the model's own loop calls the layers one by one. So each later layer
``k`` is checkpointed with the anchor as its saved input instead of its own: its forward uses the live input it was
called with (which is not kept), and its recomputation rebuilds that input by replaying layers ``0 .. k-1`` of the
unit from the anchor (grad mode on, their saved tensors dropped at once, each with the random state it had in the
forward, so the replayed input is the forward's bit for bit). The replay of the deepest layer caches the inputs of
the others, which the backward then needs in reverse order: every layer is replayed once.

The chain needs the model to pass a layer's output straight to the next layer (``x = layer(x, ...)``, as HF models
and this package's do). Where it does not, a new unit starts at that layer, with a warning.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import get_device_states, set_device_states

from lightning_moe_overlap.callbacks._checkpoint import (
    RecomputeContext,
    checkpointed,
    for_recompute,
    full_checkpoint,
    recomputing,
)
from lightning_moe_overlap.callbacks.meter import report_held

Where = tuple[str, Any]  # ("arg", index) or ("kw", name)


@dataclass
class _Call:
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict[str, Any]
    where: Where | None  # where the hidden state goes (None: the unit's first layer, args are complete)
    rng: tuple[Tensor, list[int], list[Tensor]]
    requires_grad: bool


@dataclass
class _Pass:
    """One forward of one unit (kept alive by the checkpoints of its layers)."""

    anchor: Tensor
    context: RecomputeContext | None = None  # re-entered around the replay (``recompute_context``)
    calls: list[_Call] = field(default_factory=list)
    last_out: weakref.ref | None = None
    cache: dict[int, Tensor] = field(default_factory=dict)

    def replayed_input(self, k: int) -> Tensor:
        """The input of the unit's layer ``k``, recomputed from the anchor."""
        if k in self.cache:
            return self.cache.pop(k)
        devices = sorted({d for call in self.calls[:k] for d in call.rng[1]})
        hidden: Tensor | None = None
        replay = torch.autograd.graph.saved_tensors_hooks(_same, _same)  # the replay's graph is dropped at once
        with torch.random.fork_rng(devices=devices), torch.enable_grad(), replay:
            for i in range(k):
                call = self.calls[i]
                _set_rng(call.rng)
                args, kwargs = (call.args, call.kwargs) if call.where is None else _insert(call, hidden)
                with recomputing(self.context):
                    out = call.fn(*args, **for_recompute(kwargs))
                nxt = self.calls[i + 1]
                hidden = _hidden_of(out).detach().requires_grad_(nxt.requires_grad)
                if i + 1 < k:
                    self.cache[i + 1] = hidden
        assert hidden is not None
        return hidden


class LayerUnits:
    """Wrapper factories for the ``forward`` of each layer of the given units.

    Args:
        layers: the decoder layers, in model order.
        units: each unit as a list of positions in ``layers`` (consecutive).
        context: re-entered around every recomputation (``_checkpoint.recompute_context``), None: nothing.
    """

    def __init__(
        self, layers: Sequence[nn.Module], units: Sequence[Sequence[int]], context: RecomputeContext | None = None
    ) -> None:
        self.context = context
        self.layers = list(layers)
        self.units = [list(u) for u in units]
        self._warned = False
        self._local = threading.local()  # the pass being built per unit, in the thread that runs the forward

    def wrappers(self) -> list[tuple[nn.Module, Callable[[Callable[..., Any]], Callable[..., Any]]]]:
        out = []
        for unit_id, unit in enumerate(self.units):
            for k, index in enumerate(unit):
                layer = self.layers[index]
                if len(unit) == 1:
                    out.append((layer, checkpointed(self.context)))
                else:
                    out.append((layer, self._chained(unit_id, k, layer)))
        return out

    def _chained(self, unit_id: int, k: int, layer: nn.Module) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                if not torch.is_grad_enabled():
                    return fn(*args, **kwargs)
                ref = self._passes().get(unit_id)
                state: _Pass | None = ref() if ref is not None and k > 0 else None
                where = None
                if state is not None and len(state.calls) == k and state.last_out is not None:
                    where = _find(args, kwargs, state.last_out())
                if where is None:
                    if k > 0:
                        self._warn_broken(layer)
                    return self._first(unit_id, fn, args, kwargs)
                return self._next(state, fn, where, args, kwargs)

            return run

        return wrap

    def _first(self, unit_id: int, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """The unit's first layer: a plain checkpoint, whose inputs are the anchor (and the other arguments)."""
        hidden = _hidden_arg(args, kwargs)
        if hidden is None:  # no recognisable hidden state: this layer is a unit of its own
            return _plain_checkpoint(fn, args, kwargs, context=self.context)
        state = _Pass(anchor=hidden, context=self.context)
        state.calls.append(_Call(fn, args, kwargs, None, _rng(args), hidden.requires_grad))
        self._passes()[unit_id] = weakref.ref(state)
        out = _plain_checkpoint(fn, args, kwargs, keep=state, context=self.context)
        state.last_out = weakref.ref(_hidden_of(out))
        return out

    def _next(self, state: _Pass, fn: Callable[..., Any], where: Where, args: tuple, kwargs: dict) -> Any:
        """A later layer ``k``: checkpointed with the anchor as its input, its own input replayed in backward."""
        k = len(state.calls)
        live = [_take(args, kwargs, where)]
        rest_args, rest_kwargs = _without(args, kwargs, where)
        call = _Call(fn, rest_args, rest_kwargs, where, _rng(args), live[0].requires_grad)
        state.calls.append(call)
        calls = [0]

        def segment(anchor: Tensor, *a: Any, **kw: Any) -> Any:
            calls[0] += 1
            if calls[0] == 1:
                full_args, full_kwargs = _insert(call, live.pop())
                return fn(*full_args, **full_kwargs)
            hidden = state.replayed_input(k)
            full_args, full_kwargs = _insert(call, hidden)
            with recomputing(self.context):
                return fn(*full_args, **for_recompute(full_kwargs))

        report_held([state.anchor, *rest_args, *rest_kwargs.values()])
        out = full_checkpoint(segment, state.anchor, *rest_args, **rest_kwargs)
        state.last_out = weakref.ref(_hidden_of(out))
        return out

    def _passes(self) -> dict[int, weakref.ref]:
        passes = getattr(self._local, "passes", None)
        if passes is None:
            passes = self._local.passes = {}
        return passes

    def _warn_broken(self, layer: nn.Module) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"`SelectiveRecompute`: {type(layer).__name__} was not called with the previous layer's output, so "
                "its recompute unit starts again at this layer (more inputs are kept than `num_layers` implies). "
                "Call the layers as `x = layer(x, ...)`, or use `num_layers=1`.",
                UserWarning,
                stacklevel=4,
            )


def _plain_checkpoint(
    fn: Callable[..., Any], args: tuple, kwargs: dict, keep: Any = None, context: RecomputeContext | None = None
) -> Any:
    """A checkpoint of ``fn``; ``keep`` lives as long as it (the unit's pass, held by its first layer)."""
    calls = [0]

    def segment(*a: Any, **kw: Any) -> Any:
        _ = keep
        calls[0] += 1
        if calls[0] == 1:
            return fn(*a, **kw)
        with recomputing(context):
            return fn(*a, **for_recompute(kw))

    report_held([*args, *kwargs.values()])
    return full_checkpoint(segment, *args, **kwargs)


def _same(t: Tensor) -> Tensor:
    return t


def _rng(args: tuple) -> tuple[Tensor, list[int], list[Tensor]]:
    devices, states = get_device_states(*args)
    return torch.get_rng_state(), devices, states


def _set_rng(rng: tuple[Tensor, list[int], list[Tensor]]) -> None:
    cpu, devices, states = rng
    torch.set_rng_state(cpu)
    if devices:
        set_device_states(devices, states)


def _hidden_of(out: Any) -> Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _hidden_arg(args: tuple, kwargs: dict) -> Tensor | None:
    if args and isinstance(args[0], Tensor):
        return args[0]
    value = kwargs.get("hidden_states")
    return value if isinstance(value, Tensor) else None


def _find(args: tuple, kwargs: dict, target: Tensor | None) -> Where | None:
    if target is None:
        return None
    for i, a in enumerate(args):
        if a is target:
            return ("arg", i)
    for name, value in kwargs.items():
        if value is target:
            return ("kw", name)
    return None


def _take(args: tuple, kwargs: dict, where: Where) -> Tensor:
    return args[where[1]] if where[0] == "arg" else kwargs[where[1]]


def _without(args: tuple, kwargs: dict, where: Where) -> tuple[tuple, dict]:
    if where[0] == "arg":
        return args[: where[1]] + args[where[1] + 1 :], dict(kwargs)
    return args, {k: v for k, v in kwargs.items() if k != where[1]}


def _insert(call: _Call, hidden: Tensor | None) -> tuple[tuple, dict]:
    assert call.where is not None
    kind, key = call.where
    if kind == "arg":
        return call.args[:key] + (hidden,) + call.args[key:], dict(call.kwargs)
    return call.args, {**call.kwargs, key: hidden}
