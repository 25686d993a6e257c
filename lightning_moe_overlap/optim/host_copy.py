"""``HostCopy``: one parameter's copy in host memory, on which the optimizer's update of that parameter runs.

The device parameter stays the truth: every step reads it again (so a checkpoint load or any other write to it is
seen) together with its gradient, the update runs on the host copy, and the result is written back. A parameter in
a lower precision than float32 (bfloat16, float16) gets a float32 master on the host, which keeps the low bits
between steps for as long as rounding it gives the device value; an element written elsewhere is taken from the
device. The host copy of a ``DTensor`` is a ``DTensor`` of the same mesh, placements and global shape whose local
tensor lives in host memory (as FSDP2's ``CPUOffloadPolicy`` holds its parameters), so the optimizer builds its
state in that layout and the sharded checkpoint saves and loads it as any other.

On CUDA the host buffers are pinned and the copies ``non_blocking``: the caller waits once for all the copies of a
step (``OffloadedOptimizer.step``) before the host reads them.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

LOW_PRECISION = (torch.bfloat16, torch.float16)


def local(t: Tensor) -> Tensor:
    """The tensor this rank holds: a ``DTensor``'s local shard, else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def _host_like(param: Tensor, dtype: torch.dtype, *, pin: bool) -> Tensor:
    """An empty host tensor shaped as the optimizer sees ``param``: for a ``DTensor``, a ``DTensor`` of its mesh,
    placements and global shape whose local tensor is in host memory (``empty_like`` keeps the spec and builds the
    local tensor where asked; ``DTensor.from_local`` would move it to the mesh's device)."""
    return torch.empty_like(param.detach(), dtype=dtype, device="cpu", pin_memory=pin)


class HostCopy:
    """The host side of one offloaded parameter.

    Attributes:
        param: the device parameter (the one the optimizer's groups list and the model computes with).
        master: its copy in host memory, float32 where ``param`` is in a lower precision; ``master.grad`` is the
            host copy of the gradient. What the optimizer steps in place of ``param``.
        staging: ``(parameter, gradient)`` host buffers in ``param``'s dtype, where ``master`` is float32 and
            ``param`` is not; else None (the copies go straight to ``master`` and its gradient).
    """

    def __init__(self, param: Tensor, *, pin: bool) -> None:
        dtype = torch.float32 if param.dtype in LOW_PRECISION else param.dtype

        def staging() -> Tensor:
            return torch.empty_like(local(param).detach(), device="cpu", pin_memory=pin)

        self.param = param
        self.master = _host_like(param, dtype, pin=pin)
        self.master.grad = _host_like(param, dtype, pin=pin)
        self.staging = (staging(), staging()) if dtype != param.dtype else None
        self._primed = False  # whether `master` holds a value (a float32 master is compared with the device's)

    def pull(self, *, non_blocking: bool) -> None:
        """Issue the copies of the parameter and its gradient to the host (read them after the caller's wait)."""
        assert self.param.grad is not None, "pull of a parameter without a gradient"
        param, grad = local(self.param).detach(), local(self.param.grad)
        if self.staging is None:
            local(self.master).copy_(param, non_blocking=non_blocking)
            local(self.master.grad).copy_(grad, non_blocking=non_blocking)
            return
        self.staging[0].copy_(param, non_blocking=non_blocking)
        self.staging[1].copy_(grad, non_blocking=non_blocking)

    def land(self) -> None:
        """Once the copies of :meth:`pull` are complete: fill the float32 master and its gradient from the staging
        buffers, keeping the master's value wherever rounding it still gives the device's."""
        if self.staging is None:
            return
        master, seen = local(self.master), self.staging[0]
        if self._primed:
            written = master.to(seen.dtype) != seen  # elements the device got from elsewhere (a checkpoint load)
            master.copy_(torch.where(written, seen.to(master.dtype), master))
        else:
            master.copy_(seen)
            self._primed = True
        local(self.master.grad).copy_(self.staging[1])

    def push(self, *, non_blocking: bool) -> None:
        """Issue the copy of the updated host value back into the device parameter."""
        if self.staging is None:
            local(self.param).detach().copy_(local(self.master), non_blocking=non_blocking)
            return
        self.staging[0].copy_(local(self.master))  # rounded to the parameter's dtype on the host
        local(self.param).detach().copy_(self.staging[0], non_blocking=non_blocking)

    def nbytes(self) -> int:
        """Bytes of host memory this copy holds (master, gradient, staging)."""
        buffers = [local(self.master), local(self.master.grad), *(self.staging or ())]
        return sum(t.numel() * t.element_size() for t in buffers)
