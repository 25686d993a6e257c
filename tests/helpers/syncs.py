"""Count, on CPU, the calls that force a device-to-host sync (or a host-to-device copy of a host list) on CUDA.

On CPU nothing waits, so the count is of the *ops* that would: ``aten._local_scalar_dense`` (``item()``,
``int()``, ``bool()`` of a tensor), ``aten.nonzero``, ``aten.bincount`` and ``aten.repeat_interleave`` without
``output_size`` (they read data back to size their output), ``aten.lift_fresh`` (``torch.tensor(host data)``,
an H2D copy once moved to the GPU), seen through a ``TorchDispatchMode``; plus ``Tensor.tolist``, ``.cpu()``
and ``.numpy()``, which read memory without the dispatcher and are counted by patching them.

Only the calling thread is observed (dispatch modes are thread-local), which is where autograd runs the backward
of CPU tensors.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SYNC_OPS = {
    "aten._local_scalar_dense.default": "item",
    "aten.nonzero.default": "nonzero",
    "aten.bincount.default": "bincount",
    "aten.lift_fresh.default": "tensor_from_host",
}


class _SyncOps(TorchDispatchMode):
    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = str(func)
        if name in _SYNC_OPS:
            self.counts[_SYNC_OPS[name]] += 1
        elif name.startswith("aten.repeat_interleave.Tensor") and kwargs.get("output_size") is None:
            self.counts["repeat_interleave"] += 1
        return func(*args, **kwargs)


@contextmanager
def count_host_syncs() -> Iterator[Counter]:
    """``with count_host_syncs() as counts:`` ... ``sum(counts.values())`` is the number of sync-causing calls."""
    counts: Counter = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu", "numpy")}

    def counted(name: str) -> Any:
        original = originals[name]

        def call(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return original(self, *args, **kwargs)

        return call

    for name in originals:
        setattr(torch.Tensor, name, counted(name))
    try:
        with _SyncOps(counts):
            yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
