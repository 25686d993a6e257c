"""A snapshot of the default random generators, so each execution context draws from its own stream.

The CPU and CUDA default generators are process-wide, not per thread. Inside an ``F|B`` pair the two contexts
interleave at every hand-over, so without care the forward's dropout would draw from the middle of a
checkpointed layer's recompute (which re-seeds the generator to replay the forward's masks) and both would differ
from the sequential run. The baton therefore saves the generator state of the context that gives the baton away
and restores the state of the context that receives it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class RngState:
    """The CPU generator state and, when CUDA is in use, the state of the current device's generator."""

    cpu: Tensor
    cuda: Tensor | None = None
    cuda_device: int | None = None

    @classmethod
    def capture(cls) -> RngState:
        if not torch.cuda.is_initialized():  # never initialises CUDA itself
            return cls(torch.get_rng_state())
        device = torch.cuda.current_device()
        return cls(torch.get_rng_state(), torch.cuda.get_rng_state(device), device)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.cuda_device)
