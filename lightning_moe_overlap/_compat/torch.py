"""Every private torch name this package uses, in one place (the supported range is pinned in pyproject).

Names are reached through functions, looked up when called, so importing this module never touches CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor


def foreach_norm(tensors: Sequence[Tensor], ord: float, *, dtype: torch.dtype | None = None) -> tuple[Tensor, ...]:
    """``torch._foreach_norm``: one fused kernel for the norms of many tensors (same device and dtype)."""
    return torch._foreach_norm(list(tensors), ord, dtype=dtype)


def foreach_mul_(tensors: Sequence[Tensor], scalar: Tensor) -> None:
    """``torch._foreach_mul_`` by a 0-d tensor: scales many tensors in place without reading ``scalar`` back."""
    torch._foreach_mul_(list(tensors), scalar)


def cuda_sleep(cycles: int) -> None:
    """``torch.cuda._sleep``: a kernel that spins the current stream for ``cycles`` GPU clock cycles."""
    torch.cuda._sleep(int(cycles))


def top_saved_tensors_hooks() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """``torch._C._autograd._top_saved_tensors_default_hooks``: this thread's innermost ``saved_tensors_hooks``
    pair ``(pack, unpack)``, or None when none is active (or this torch has no such function)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return None if top is None else top(False)
