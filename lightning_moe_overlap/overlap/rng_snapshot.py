"""A snapshot of the default random generators, so each execution context draws from its own stream.

The CPU and CUDA default generators are process-wide, not per thread. Inside an ``F|B`` pair the two contexts
interleave at every hand-over, so without care the forward's dropout would draw from the middle of a
checkpointed layer's recompute (which re-seeds the generator to replay the forward's masks) and both would differ
from the sequential run. The baton therefore saves the generator state of the context that gives the baton away
and restores the state of the context that receives it.

Which CUDA generator: each CUDA device has its own, and the *current device* is thread-local. The engine's lanes
are new threads (current device 0) that make the step's device current only while a task runs, and a context
also gives the baton away after its task returned (when it finishes). So the device is never read from the
calling thread at capture or restore time: :class:`RngSource` fixes it once, in the thread that starts the step,
and every snapshot of that step captures and restores that device's generator. Reading the thread's device would
save cuda:0's state on every rank whose GPU is not cuda:0, and two micro-batches would draw the same dropout masks.

``generators`` is the device module the states are read from and written to: ``torch.cuda`` (the default), or
any object with the same four functions (tests emulate CUDA's per-thread current device with one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor


class DeviceGenerators(Protocol):
    """The part of ``torch.cuda`` the snapshots use."""

    def is_initialized(self) -> bool: ...

    def current_device(self) -> int: ...

    def get_rng_state(self, device: int) -> Tensor: ...

    def set_rng_state(self, new_state: Tensor, device: int) -> None: ...


@dataclass(frozen=True)
class RngState:
    """The CPU generator state and, when a device is in use, the state of that device's generator."""

    cpu: Tensor
    device_state: Tensor | None = None
    device: int | None = None
    generators: Any = field(default=torch.cuda, repr=False, compare=False)

    def restore(self) -> None:
        """Write the states back, the device's into the generator of the device it was read from."""
        torch.set_rng_state(self.cpu)
        if self.device_state is not None:
            self.generators.set_rng_state(self.device_state, self.device)


@dataclass(frozen=True)
class RngSource:
    """The generators one step's contexts share: the CPU one and, if a device is in use, that device's.

    Attributes:
        device: the device whose generator is saved and restored; None on CPU (or before CUDA started).
        generators: where device generator states are read and written (``torch.cuda`` by default).
    """

    device: int | None = None
    generators: Any = field(default=torch.cuda, repr=False, compare=False)

    @classmethod
    def of_current_thread(cls, generators: DeviceGenerators | None = None) -> RngSource:
        """The calling thread's current device (call it in the thread that starts the step); never initialises
        CUDA itself."""
        generators = torch.cuda if generators is None else generators
        if not generators.is_initialized():
            return cls(None, generators)
        return cls(generators.current_device(), generators)

    def capture(self) -> RngState:
        """The states now, of the CPU generator and of ``device``'s (whatever the calling thread's device is)."""
        if self.device is None:
            return RngState(torch.get_rng_state())
        return RngState(
            torch.get_rng_state(), self.generators.get_rng_state(self.device), self.device, self.generators
        )
