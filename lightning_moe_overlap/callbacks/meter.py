"""Count the activation bytes autograd holds for backward, on any device (the CPU measure of the memory benchmark).

``torch.cuda.max_memory_allocated`` answers "how much activation memory" on a GPU; a CPU has no such counter. The
meter answers it from the saved tensors instead: inside ``with meter:`` (in the thread that runs the forward)
every tensor autograd saves passes its pack hook, the recompute wrapper reports the inputs a checkpoint keeps, and
the offload engine reports what it keeps on the device and what it moved to the host. ``held_bytes()`` is the
size of the distinct storages among them that are still alive, parameters excluded: the activation memory the
backward still needs. Call it right after a forward for the peak of a sequential micro-batch.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn
from typing_extensions import Self

from lightning_moe_overlap.parallel.dtensors import local

_local = threading.local()


def current_meter() -> SavedActivationMeter | None:
    """The meter active in this thread, if any."""
    return getattr(_local, "meter", None)


def report_held(values: Iterable[Any]) -> None:
    """Tell the active meter that these tensors (or tuples/lists of them) stay alive for backward."""
    meter = current_meter()
    if meter is None:
        return
    for value in values:
        for t in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(t, Tensor):
                meter.record(t)


class SavedActivationMeter:
    """Saved-tensor accounting of the activation memory kept for backward.

    Args:
        model: its parameters (and buffers) are not activations and are never counted.
    """

    def __init__(self, model: nn.Module | None = None) -> None:
        self._excluded = set()
        if model is not None:
            self._excluded = {_ptr(local(t)) for t in (*model.parameters(), *model.buffers())}
        self._held: list[weakref.ref[Tensor]] = []
        self._host: list[weakref.ref[Tensor]] = []
        self._hooks: Any = None
        self._previous: SavedActivationMeter | None = None

    def __enter__(self) -> Self:
        self._previous = current_meter()
        _local.meter = self
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        _local.meter = self._previous

    def _pack(self, t: Tensor) -> Tensor:
        self.record(t)
        return t

    def record(self, t: Tensor) -> None:
        """Count ``t``'s storage while ``t`` is alive (device memory held for backward)."""
        self._held.append(weakref.ref(t))

    def record_offloaded(self, host: Tensor) -> None:
        """Count a host copy made by the offload engine while it is alive."""
        self._host.append(weakref.ref(host))

    def held_bytes(self) -> int:
        """Bytes of the distinct live storages recorded, parameters excluded."""
        return _distinct_bytes(self._held, self._excluded)

    def offloaded_bytes(self) -> int:
        """Bytes of the live host copies."""
        return _distinct_bytes(self._host, set())

    def reset(self) -> None:
        """Forget everything recorded so far."""
        self._held.clear()
        self._host.clear()


def _unpack(t: Tensor) -> Tensor:
    return t


def _ptr(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _distinct_bytes(refs: list[weakref.ref[Tensor]], excluded: set[int]) -> int:
    sizes: dict[int, int] = {}
    for ref in refs:
        t = ref()
        if t is None:
            continue
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in excluded:
            sizes[ptr] = max(sizes.get(ptr, 0), storage.nbytes())
    return sum(sizes.values())
