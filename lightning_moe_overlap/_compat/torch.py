"""Every private torch name this package uses, in one place (the supported range is pinned in pyproject).

Names are reached through functions, looked up when called, so importing this module never touches CUDA; the one
private method the package extends (``nn.Module._apply``) is extended here, by ``Float32Buffers``.
Each name has a test in ``tests/unit/test_compat_torch.py`` that names the torch version when it fails.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn


def foreach_norm(tensors: Sequence[Tensor], ord: float, *, dtype: torch.dtype | None = None) -> tuple[Tensor, ...]:
    """``torch._foreach_norm``: one fused kernel for the norms of many tensors (same device and dtype)."""
    return torch._foreach_norm(list(tensors), ord, dtype=dtype)


def foreach_mul_(tensors: Sequence[Tensor], scalar: Tensor) -> None:
    """``torch._foreach_mul_`` by a 0-d tensor: scales many tensors in place without reading ``scalar`` back."""
    torch._foreach_mul_(list(tensors), scalar)


def cuda_sleep(cycles: int) -> None:
    """``torch.cuda._sleep``: a kernel that spins the current stream for ``cycles`` GPU clock cycles."""
    torch.cuda._sleep(int(cycles))


def grouped_mm_available() -> bool:
    """Whether this torch build has ``torch._grouped_mm`` (which devices and dtypes it runs is the caller's check)."""
    return hasattr(torch, "_grouped_mm")


def grouped_mm(mat_a: Tensor, mat_b: Tensor, *, offs: Tensor) -> Tensor:
    """``torch._grouped_mm``: one GEMM per group of rows delimited by the int32 end offsets ``offs``.

    Goes through the public ``torch.nn.functional.grouped_mm`` where this torch has it (a thin wrapper of the same
    op), so only older builds reach the private name.
    """
    public = getattr(torch.nn.functional, "grouped_mm", None)
    if public is not None:
        return public(mat_a, mat_b, offs=offs)
    return torch._grouped_mm(mat_a, mat_b, offs=offs)


def current_graph_task_id() -> int:
    """``torch._C._current_graph_task_id``: the id of the backward pass running on this thread, ``-1`` outside one."""
    return torch._C._current_graph_task_id()


def top_saved_tensors_hooks() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """``torch._C._autograd._top_saved_tensors_default_hooks``: the innermost ``(pack, unpack)`` saved-tensor hooks
    of this thread (those of ``torch.autograd.graph.saved_tensors_hooks`` and of ``torch.utils.checkpoint``), or
    ``None`` when none is pushed or this torch cannot tell."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:  # pragma: no cover - older torch
        return None
    return top(False)  # ignore_is_tracing=False


def default_store() -> dist.Store:
    """``torch.distributed.distributed_c10d._get_default_store``: the default process group's c10d store."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


class Float32Buffers(nn.Module):
    """A module whose buffers named in ``float32_buffers`` stay float32 through ``.to(dtype)``, ``.half()``,
    ``.bfloat16()``: it extends ``torch.nn.Module._apply``, the method every such conversion goes through."""

    float32_buffers: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def, override]
        module = super()._apply(fn, recurse)
        for name in self.float32_buffers:
            buffer = getattr(self, name, None)
            if buffer is not None and buffer.dtype != torch.float32:
                buffer.data = buffer.data.float()
        return module
