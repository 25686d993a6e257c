"""A hand-over in the backward only, with nothing in flight: ``backward_handoff(x, runtime, count)``.

The experts place one where the dispatcher's backward has fewer comm points than its forward (a token-count or
index exchange has no gradient), so that both contexts of a schedule meet the same number of hand-overs in each
direction (``moe/dispatch/base.py``'s ``backward_handoffs``, ``moe/grouped.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_moe_overlap.overlap.runtime import CommRuntime


class _BackwardHandoff(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, runtime: CommRuntime, count: int) -> Tensor:  # type: ignore[override]
        ctx.runtime, ctx.count = runtime, count
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        for _ in range(ctx.count):
            ctx.runtime.handoff()
        return g, None, None


def backward_handoff(x: Tensor, runtime: CommRuntime | None, count: int = 1) -> Tensor:
    """``x`` unchanged; when the gradient passes back through it, hand over ``count`` times, nothing in flight.

    Forward: no hand-over. No-op (``x`` itself) without a runtime, with ``count == 0`` or when ``x`` needs no
    gradient.
    """
    if runtime is None or count == 0 or not (torch.is_grad_enabled() and x.requires_grad):
        return x
    return _BackwardHandoff.apply(x, runtime, count)
