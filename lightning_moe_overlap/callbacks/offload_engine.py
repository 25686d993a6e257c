"""The offload engine: saved activations go to host memory during forward and come back before backward needs them.

Groups. Each decoder-layer forward is a *group*: its forward pre-hook opens it (pushes this engine's
``saved_tensors_hooks`` in the thread that runs the forward), its forward hook closes it. While a group is open,
the pack hook moves a saved tensor to the host when it is *wanted*: its storage belongs to an activation tagged
with one of the wanted tensor names (``dispatched_input``, ``pre_mlp_layernorm_output``), or it is saved while
the thread is inside a region with one of the wanted module names (``core_attn``, ``expert_fc1``, ...), and it is
at least ``min_tensor_size`` bytes. Parameters and leaves that require grad are never moved. A storage is copied
once per group however many views of it are saved (the q, k, v views of one projection: one copy); the unpack
hook rebuilds each view on the reloaded storage, with its offset and strides, so backward sees the same layout.

Inside a ``torch.utils.checkpoint`` region nothing is packed here: the checkpoint's own hook is on top (its
tensors are recomputed, not saved), and a group opened inside a checkpoint (forward or recomputation) is skipped.

Copies. :class:`CudaCopier`: pinned host buffers (PyTorch's caching host allocator), the device-to-host copy on
its own stream after the compute stream's work, the host-to-device copy on another stream after the offload
finished; the compute stream waits for the reload by event: no host synchronisation. The device storage is kept
by the group until the layer's forward ends (as Megatron's group offload does), then released with
``record_stream``. :class:`CpuCopier` runs the same engine with plain copies into a separate buffer: the CPU twin
that the tests check bit for bit.

Prefetch: the first unpack of a group (backward reached that layer) starts the reload of the group opened just
before it in the same forward, i.e. the next layer backward will reach: reloads run one layer ahead.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_moe_overlap.callbacks import _forward_regions
from lightning_moe_overlap.callbacks.meter import current_meter


class CpuCopier:
    """Synchronous copies into a separate buffer (the CPU twin of :class:`CudaCopier`)."""

    def to_host(self, src: Tensor) -> tuple[Tensor, Any]:
        return src.clone(), None

    def to_device(self, host: Tensor, device: torch.device, after: Any) -> tuple[Tensor, Any]:
        dev = torch.empty_like(host, device=device)
        dev.copy_(host)
        return dev, None

    def ready(self, dev: Tensor, event: Any) -> None:
        return None


class CudaCopier:
    """D2H and H2D copies on their own streams into / out of pinned host memory, ordered by events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)

    def to_host(self, src: Tensor) -> tuple[Tensor, Any]:
        host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))  # the tensor is complete on the compute stream
        with torch.cuda.stream(self.d2h):
            host.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.d2h)
        src.record_stream(self.d2h)  # the allocator keeps the block until the copy ran
        return host, done

    def to_device(self, host: Tensor, device: torch.device, after: Any) -> tuple[Tensor, Any]:
        with torch.cuda.stream(self.h2d):
            if after is not None:
                self.h2d.wait_event(after)
            dev = torch.empty(host.shape, dtype=host.dtype, device=device)
            dev.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.h2d)
        return dev, done

    def ready(self, dev: Tensor, event: Any) -> None:
        stream = torch.cuda.current_stream(dev.device)
        stream.wait_event(event)
        dev.record_stream(stream)


@dataclass
class OffloadStats:
    """Totals of one engine (since it was built or reset)."""

    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    reloaded_bytes: int = 0


class _Entry:
    """One storage moved to the host; freed when the last saved tensor that refers to it is."""

    def __init__(self, group: _Group, host: Tensor, event: Any, device: torch.device) -> None:
        self.group, self.host, self.event, self.device = group, host, event, device
        self.loaded: Tensor | None = None
        self.loaded_event: Any = None

    def prefetch(self) -> None:
        engine = self.group.engine
        with engine.lock:
            if self.loaded is None:
                copier = engine.copier(self.device)
                self.loaded, self.loaded_event = copier.to_device(self.host, self.device, self.event)
                engine.stats.reloaded_bytes += self.host.numel()

    def load(self) -> Tensor:
        self.prefetch()
        assert self.loaded is not None
        self.group.engine.copier(self.device).ready(self.loaded, self.loaded_event)
        return self.loaded


@dataclass(frozen=True)
class _Packed:
    entry: _Entry
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


class _Group:
    """The saved tensors of one layer forward."""

    def __init__(self, engine: OffloadEngine, prev: weakref.ref | None) -> None:
        self.engine = engine
        self.prev = prev
        self.tags: dict[int, Tensor] = {}  # storage pointer -> tagged tensor (kept until close: no address reuse)
        self.by_storage: dict[int, _Entry] = {}
        self.keep: list[Tensor] = []
        self.entries: list[weakref.ref[_Entry]] = []
        self.unpacked = False
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack)

    def pack(self, t: Tensor) -> Any:
        if not self.engine.wants(t, self):
            meter = current_meter()
            if meter is not None:
                meter.record(t)
            return t
        storage = t.untyped_storage()
        entry = self.by_storage.get(storage.data_ptr())
        if entry is None:
            entry = self._offload(t, storage)
        return _Packed(entry, t.storage_offset(), tuple(t.size()), tuple(t.stride()), t.dtype)

    def _offload(self, t: Tensor, storage: torch.UntypedStorage) -> _Entry:
        engine = self.engine
        raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
        host, event = engine.copier(t.device).to_host(raw)
        entry = _Entry(self, host, event, t.device)
        self.by_storage[storage.data_ptr()] = entry
        self.keep.append(t)
        self.entries.append(weakref.ref(entry))
        with engine.lock:
            engine.stats.offloaded_tensors += 1
            engine.stats.offloaded_bytes += host.numel()
        meter = current_meter()
        if meter is not None:
            meter.record_offloaded(host)
        return entry

    def close(self) -> None:
        """The layer's forward is over: release the device storages (the copies hold the data now)."""
        self.tags.clear()
        self.by_storage.clear()
        self.keep.clear()

    def prefetch(self) -> None:
        for ref in self.entries:
            entry = ref()
            if entry is not None:
                entry.prefetch()


def _unpack(packed: Any) -> Tensor:
    if not isinstance(packed, _Packed):
        return packed
    group = packed.entry.group
    if not group.unpacked:  # backward reached this layer: bring the next one (the previous layer) back now
        group.unpacked = True
        prev = group.prev() if group.prev is not None else None
        if prev is not None:
            prev.prefetch()
    raw = packed.entry.load()
    view = torch.empty(0, dtype=packed.dtype, device=raw.device)
    return view.set_(raw.untyped_storage(), packed.offset, packed.size, packed.stride)


class OffloadEngine:
    """Moves the wanted saved tensors of each layer group to the host and back.

    Args:
        modules: region names whose saved tensors are offloaded.
        tensors: tag names whose tensors (any view of their storage) are offloaded when saved.
        min_tensor_size: smallest storage, in bytes, worth moving.
        exclude: tensors never offloaded (the model's parameters and buffers).
    """

    def __init__(
        self,
        *,
        modules: Collection[str],
        tensors: Collection[str],
        min_tensor_size: int,
        exclude: Iterable[Tensor] = (),
    ) -> None:
        self.modules = frozenset(modules)
        self.tensors = frozenset(tensors)
        self.min_tensor_size = min_tensor_size
        self.excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self.stats = OffloadStats()
        self.lock = threading.RLock()
        self._copiers: dict[torch.device, CpuCopier | CudaCopier] = {}
        self._local = threading.local()

    def copier(self, device: torch.device) -> CpuCopier | CudaCopier:
        copier = self._copiers.get(device)
        if copier is None:
            copier = CudaCopier(device) if device.type == "cuda" else CpuCopier()
            self._copiers[device] = copier
        return copier

    # -- groups (called from the layers' forward hooks, in the forward's thread) ----------------------------------
    def open_group(self) -> None:
        stack = self._stack()
        if _forward_regions.inside_checkpoint():
            stack.append(None)
            return
        group = _Group(self, getattr(self._local, "last", None))
        group.hooks.__enter__()
        stack.append(group)
        self._local.last = weakref.ref(group)

    def close_group(self) -> None:
        stack = self._stack()
        if not stack:
            return
        group = stack.pop()
        if group is not None:
            group.hooks.__exit__(None, None, None)
            group.close()

    def tag(self, name: str, tensor: Tensor) -> None:
        """Mark ``tensor``'s storage as the activation ``name`` in the open group (ignored when not wanted)."""
        stack = self._stack()
        if name in self.tensors and stack and stack[-1] is not None and isinstance(tensor, Tensor):
            stack[-1].tags[tensor.untyped_storage().data_ptr()] = tensor

    def wants(self, t: Tensor, group: _Group) -> bool:
        if t.layout != torch.strided or t.device.type not in ("cpu", "cuda") or (t.is_leaf and t.requires_grad):
            return False
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.excluded or storage.nbytes() < max(self.min_tensor_size, 1):
            return False
        if ptr in group.tags:
            return True
        regions = _forward_regions.active()
        return any(regions[name] > 0 for name in self.modules)

    def _stack(self) -> list[_Group | None]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack
