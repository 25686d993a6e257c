"""Count the calls that would make the CPU wait for a CUDA device, while running on CPU.

On CPU nothing waits, so a host sync on the GPU path is invisible to a CPU test unless the ops that cause one
are counted. ``SyncCounter`` counts them two ways:

- Python-level calls patched on ``torch.Tensor`` / ``torch``: ``tolist``, ``item``, ``cpu``, ``numpy``, ``cuda``,
  ``bool()`` / ``int()`` / ``float()`` of a tensor, ``.to(<device>)`` and ``torch.tensor`` / ``torch.as_tensor``
  with a ``device`` (a host-to-device copy from pageable memory on CUDA);
- ATen ops seen by a ``TorchDispatchMode`` (they may be called from C++ or from megatron-core): reading a scalar
  back (``_local_scalar_dense``), ``nonzero``, ``bincount``, ``unique``, ``masked_select``, ``histc``,
  ``repeat_interleave`` without ``output_size``, and indexing with a boolean mask.

Each sync is logged as ``"sync:<name>"`` in ``log`` (shared with whatever else the test logs, to check the
order of syncs against comm points) and counted in ``counts``. ``paused()`` stops counting, for test doubles
that stand in for another library.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_METHODS = ("tolist", "item", "cpu", "numpy", "cuda", "__bool__", "__int__", "__float__")
_ATEN_SYNCS = {
    "_local_scalar_dense",
    "nonzero",
    "bincount",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "masked_select",
    "histc",
}


def _is_device(arg: object) -> bool:
    return isinstance(arg, torch.device) or (isinstance(arg, str) and arg.split(":")[0] in ("cpu", "cuda", "meta"))


class _AtenCounter(TorchDispatchMode):
    def __init__(self, counter: SyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        if name in _ATEN_SYNCS:
            self.counter.record(f"aten.{name}")
        elif name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) < 3:
            self.counter.record("aten.repeat_interleave")
        elif name in ("index", "index_put", "index_put_"):
            indices = args[1] if len(args) > 1 else ()
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
                self.counter.record(f"aten.{name}(bool mask)")
        return func(*args, **kwargs)


class SyncCounter:
    """Context manager: counts would-be host syncs; see the module docstring."""

    def __init__(self, log: list[str] | None = None) -> None:
        self.log = [] if log is None else log
        self.counts: Counter[str] = Counter()
        self._paused = 0
        self._stack = contextlib.ExitStack()

    def record(self, name: str) -> None:
        if not self._paused:
            self.counts[name] += 1
            self.log.append(f"sync:{name}")

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _wrap_method(self, name: str) -> None:
        original = getattr(torch.Tensor, name)

        @functools.wraps(original)
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.record(name.strip("_"))
            with self.paused():  # the op's own internals are not counted again
                return original(tensor, *args, **kwargs)

        self._patch(torch.Tensor, name, counted)

    def _wrap_to(self) -> None:
        original = torch.Tensor.to

        @functools.wraps(original)
        def to(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if "device" in kwargs or any(_is_device(a) for a in args):
                self.record("to(device)")
            return original(tensor, *args, **kwargs)

        self._patch(torch.Tensor, "to", to)

    def _wrap_factory(self, name: str) -> None:
        original = getattr(torch, name)

        @functools.wraps(original)
        def factory(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("device") is not None:
                self.record(f"torch.{name}(device=...)")
            return original(*args, **kwargs)

        self._patch(torch, name, factory)

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        had = name in vars(owner)
        old = vars(owner).get(name)
        setattr(owner, name, value)
        self._stack.callback(lambda: setattr(owner, name, old) if had else delattr(owner, name))

    def thread_counter(self) -> TorchDispatchMode:
        """A dispatch mode counting into this counter, for another thread (dispatch modes are thread-local:
        enter one in each of the overlap engine's contexts through its ``context_factory``)."""
        return _AtenCounter(self)

    def __enter__(self) -> SyncCounter:
        for name in _METHODS:
            self._wrap_method(name)
        self._wrap_to()
        for name in ("tensor", "as_tensor"):
            self._wrap_factory(name)
        self._stack.enter_context(_AtenCounter(self))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
