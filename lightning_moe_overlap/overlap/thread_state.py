"""PyTorch thread-local state carried from the thread that starts a schedule into each execution context.

A new thread starts with PyTorch's defaults: grad mode on, no autocast, CUDA device 0 and its default stream.
:meth:`ThreadState.capture` reads the caller's state and :meth:`ThreadState.applied` re-establishes it around
every task, in the thread that runs it. Propagated:

- grad mode (``torch.is_grad_enabled``) and inference mode;
- autocast, per device type (``cpu``, ``cuda``, ``xpu``, ``hpu``, ``mps``): enabled flag and dtype, and the
  autocast weight-cache flag;
- the CUDA current device and current stream (see ``streams.py``), when CUDA is in use;
- the intra-op thread count (``torch.set_num_threads``): OpenMP keeps it per thread, and a new thread starts at
  OpenMP's default (the number of cores) whatever ``torch.get_num_threads`` reports, so GEMMs on a context thread
  could be blocked differently from the same GEMMs on the caller's thread and differ in the last bit.

Not propagated, because PyTorch has no public API to read them: saved-tensor hooks
(``torch.autograd.graph.saved_tensors_hooks``), ``TorchFunctionMode``/``TorchDispatchMode`` stacks (including
``torch.set_default_device``). Install these through the engine's ``context_factory``. Process-wide settings
(default dtype, deterministic algorithms, anomaly mode) need no propagation. The random
generators are process-wide too; the baton gives each context its own stream (see ``rng_snapshot.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

from lightning_moe_overlap.overlap.streams import StreamState

AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "xpu", "hpu", "mps")


@dataclass(frozen=True)
class AutocastState:
    device_type: str
    dtype: torch.dtype


@dataclass(frozen=True)
class ThreadState:
    """A snapshot of the thread-local state listed in the module docstring."""

    grad_enabled: bool
    inference_mode: bool
    autocast: tuple[AutocastState, ...]
    autocast_cache: bool
    streams: StreamState
    intra_op_threads: int = 1

    @classmethod
    def capture(cls) -> ThreadState:
        """Read the calling thread's state."""
        autocast = tuple(
            AutocastState(device_type, torch.get_autocast_dtype(device_type))
            for device_type in AUTOCAST_DEVICE_TYPES
            if torch.is_autocast_enabled(device_type)
        )
        return cls(
            grad_enabled=torch.is_grad_enabled(),
            inference_mode=torch.is_inference_mode_enabled(),
            autocast=autocast,
            autocast_cache=torch.is_autocast_cache_enabled(),
            streams=StreamState.capture(),
            intra_op_threads=torch.get_num_threads(),
        )

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Establish the snapshot in the calling thread; restore that thread's own state on exit."""
        torch.set_num_threads(self.intra_op_threads)  # this thread's OpenMP count; the caller's value, so no restore
        with ExitStack() as stack:
            stack.enter_context(self.streams.applied())
            if self.inference_mode:
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            for state in self.autocast:
                stack.enter_context(
                    torch.autocast(state.device_type, dtype=state.dtype, cache_enabled=self.autocast_cache)
                )
            yield
