"""Non-reentrant ``torch.utils.checkpoint`` of a module call, made safe for expert parallelism and the overlap.

What :func:`checkpointed` adds to a plain ``checkpoint(fn, *args, use_reentrant=False)``:

- **the whole segment is recomputed.** Non-reentrant checkpoint stops a recomputation early once every saved
  tensor is back. A segment may end with communication (an MoE block ends with the combine all-to-all); if one
  rank stopped before it and another did not, their collectives would no longer match. So early stop is off for
  these checkpoints (``early_stop=False``; on a torch without that argument the segment's outputs pass through an
  identity that saves a 0-element tensor, which the recomputation must reach).
- **no side effects twice.** A recomputed router would count its tokens for the expert-bias update (and the
  routing statistics) again: a recomputation runs inside :func:`~lightning_moe_overlap.moe.router.not_counted`,
  which pauses counting on its own thread only. The counters are never snapshotted and restored: the overlap
  engine's other context may route a forward through the same router while a recomputation waits at a comm
  point, and those counts stay.
- **the KV cache is updated once.** An HF attention or layer called with a cache (``cache`` in recent
  transformers, ``past_key_values`` earlier) appends its keys and values to it; a recomputation would append them
  again. The forward uses the real cache; the
  recomputation gets a stand-in that repeats what the update of an empty cache returns (training starts every
  forward with an empty cache), so the recomputed tensors are the forward's, bit for bit.
- **accounting:** the inputs a checkpoint keeps alive are reported to an active
  :class:`~lightning_moe_overlap.callbacks.meter.SavedActivationMeter`.

Under ``torch.no_grad()`` (validation) the module runs as it is.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from lightning_moe_overlap.callbacks.meter import report_held
from lightning_moe_overlap.moe.router import not_counted

_EARLY_STOP_ARG = "early_stop" in inspect.signature(checkpoint).parameters


RecomputeContext = Callable[[], AbstractContextManager[Any]]


@contextmanager
def recomputing(context: RecomputeContext | None) -> Iterator[None]:
    """The state a recomputation runs in: router counting paused, and ``context()`` entered where given."""
    with (context() if context is not None else nullcontext()), not_counted():
        yield


def recompute_context(module: object) -> RecomputeContext | None:
    """What a recomputation of ``module``'s layers must re-enter, None if nothing: at ``cp > 1`` the ring attention
    (``module.context_parallel``, set by the strategy). A recomputation runs inside the backward, where no thread's
    ``TorchFunctionMode`` is seen, so the mode routing SDPA to the ring is entered again around it (what
    ``checkpoint(..., context_fn=...)`` does for its recomputation)."""
    cp = getattr(module, "context_parallel", None)
    return None if cp is None else cp.attention.thread_context


def full_checkpoint(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Non-reentrant ``checkpoint(fn, *args, **kwargs)`` whose recomputation always runs ``fn`` to its end."""
    if _EARLY_STOP_ARG:
        return checkpoint(fn, *args, use_reentrant=False, early_stop=False, **kwargs)
    return checkpoint(lambda *a, **k: keep_tail(fn(*a, **k)), *args, use_reentrant=False, **kwargs)


class _KeepTail(torch.autograd.Function):
    """Identity that saves a 0-element tensor: the recomputation must reach it, i.e. the end of the segment."""

    @staticmethod
    def forward(ctx, *xs: Tensor) -> Any:  # type: ignore[override]
        ctx.save_for_backward(torch.empty(0, device=xs[0].device))
        outs = tuple(x.view_as(x) for x in xs)
        return outs if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grads: Tensor) -> Any:  # type: ignore[override]
        return grads if len(grads) > 1 else grads[0]


def keep_tail(out: Any) -> Any:
    """``out`` with its grad-requiring tensors (top level or in a tuple/list) routed through :class:`_KeepTail`."""
    if isinstance(out, Tensor):
        return _KeepTail.apply(out) if out.requires_grad else out
    if isinstance(out, (tuple, list)):
        index = [i for i, x in enumerate(out) if isinstance(x, Tensor) and x.requires_grad]
        if not index:
            return out
        kept = _KeepTail.apply(*(out[i] for i in index))
        kept = kept if isinstance(kept, tuple) else (kept,)
        items = list(out)
        for i, t in zip(index, kept):
            items[i] = t
        return type(out)(items) if isinstance(out, list) else tuple(items)
    return out


class RecomputeCache:
    """Stands in for an HF cache in a recomputation: returns what updating an empty ``DynamicCache`` returns."""

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        empty = torch.tensor([], dtype=key_states.dtype, device=key_states.device)
        return torch.cat([empty, key_states], dim=-2), torch.cat([empty, value_states], dim=-2)


CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")  # transformers 5.x renamed past_key_values to cache


def for_recompute(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` of a recomputation: an HF KV cache (under any of :data:`CACHE_KWARGS`) replaced by
    :class:`RecomputeCache`."""
    caches = [name for name in CACHE_KWARGS if kwargs.get(name) is not None]
    if not caches:
        return kwargs
    return {**kwargs, **{name: RecomputeCache() for name in caches}}


def checkpointed(context: RecomputeContext | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A wrapper factory: ``fn`` becomes a non-reentrant checkpoint of itself (see the module docstring); its
    recomputation runs inside :func:`~lightning_moe_overlap.moe.router.not_counted` and inside ``context()``
    where given (:func:`recompute_context`)."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return fn(*args, **kwargs)
            calls = [0]

            def segment(*a: Any, **k: Any) -> Any:
                calls[0] += 1
                if calls[0] == 1:
                    return fn(*a, **k)
                with recomputing(context):
                    return fn(*a, **for_recompute(k))

            report_held(args)
            report_held(kwargs.values())
            return full_checkpoint(segment, *args, **kwargs)

        return run

    return wrap
