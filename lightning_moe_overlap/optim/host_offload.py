"""``OffloadedOptimizer``: the user's optimizer with the state and update of a share of its parameters in host memory.

Built from the optimizer ``configure_optimizers`` returned (``MoEOverlapStrategy(optimizer_cpu_offload=True)`` wraps
it after ``setup_optimizers``), it keeps that optimizer's ``param_groups`` and ``state`` as they are (the same
objects: an LR scheduler built on the user's optimizer keeps working, and torch's state-dict API reads both), and
runs the user's optimizer's own ``step`` twice per step:

1. over the parameters kept on the device (the offloaded ones taken out of its groups for the call);
2. over the host copies of the offloaded parameters (:class:`~.host_copy.HostCopy`), listed in their groups in place
   of the device parameters, their state entries keyed by the copies for the call; then the updated values are
   copied back into the device parameters.

The two calls equal one step over every parameter for an optimizer whose update of a parameter reads only that
parameter, its gradient, its own state and its group's hyper-parameters (torch's Adam, AdamW, SGD, Adagrad, RMSprop,
...): the validation rule ``offload-optimizer`` refuses the ones known not to. The gradients it reads are the device
gradients as they are when ``step`` runs: clipped by the global norm, unscaled by a ``GradScaler``.

Which parameters: the largest first (by the elements this rank holds), until they hold at least ``fraction`` of the
elements of every parameter it steps (:func:`choose_offloaded`).

Why not FSDP2's ``CPUOffloadPolicy`` or torchao's ``CPUOffloadOptimizer`` (docs/memory.md, "Optimizer CPU offload"):
the first moves the parameters and gradients of every module to the host too, only in the sharded modes, and not
the experts in ``shard="none"``; the second builds its own optimizer per parameter from a class (the user's
optimizer, its groups and an LR scheduler on it are not kept), keeps its own state-dict format (not torch's, which
the sharded checkpoint reads by parameter name), offloads by a minimum size rather than a share, and runs on CUDA
and XPU only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_moe_overlap.optim.host_copy import HostCopy, local
from lightning_moe_overlap.validation import check_offload_optimizer, raise_problems


def choose_offloaded(params: Iterable[Tensor], fraction: float) -> list[Tensor]:
    """The parameters whose state and update go to the host: the largest first (elements held on this rank; ties in
    the given order) until they hold at least ``fraction`` of the elements of every parameter that can step
    (``requires_grad``, not on the meta device). ``fraction=1.0``: every such parameter with at least one element."""
    held = [p for p in params if p.requires_grad and not p.is_meta]
    return [held[i] for i in largest_first([local(p).numel() for p in held], fraction)]


def largest_first(sizes: Sequence[int], fraction: float) -> list[int]:
    """The indices of ``sizes``, largest first (ties in the given order), until they hold at least ``fraction`` of
    the total: :func:`choose_offloaded`'s rule on element counts (``check``'s memory estimate uses it too)."""
    total, count, chosen = sum(sizes), 0, []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        if count >= fraction * total:
            break
        chosen.append(i)
        count += sizes[i]
    return chosen


@dataclass(frozen=True)
class StateBytes:
    """Bytes of optimizer state by the side that holds it.

    Attributes:
        device: state of the parameters updated on the device.
        host: state of the offloaded parameters, in host memory.
        host_copies: the host copies of the offloaded parameters and their gradients (float32 masters included).
    """

    device: int
    host: int
    host_copies: int


class OffloadedOptimizer(torch.optim.Optimizer):
    """``optimizer`` with the state and update of ``offloaded`` (some of its parameters) in host memory.

    Like torchao's ``CPUOffloadOptimizer`` it subclasses ``Optimizer`` (for ``isinstance`` checks) without calling
    its ``__init__``: ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's own.

    Args:
        optimizer: the optimizer to wrap (a torch ``Optimizer``; not stepped yet, or with its state on the device).
        offloaded: the parameters (of ``optimizer``'s groups) whose state and update live on the host.
        device: the device the parameters live on; on CUDA the host buffers are pinned and the copies asynchronous.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, offloaded: Sequence[Tensor], device: torch.device) -> None:
        listed = {id(p) for g in optimizer.param_groups for p in g["params"]}
        strays = [tuple(p.shape) for p in offloaded if id(p) not in listed]
        if strays:
            raise ValueError(
                f"`OffloadedOptimizer`: {len(strays)} of the parameters to offload (shapes {strays[:3]}) are not in "
                f"`{type(optimizer).__name__}`'s parameter groups. Offload parameters of the optimizer it wraps."
            )
        self.inner = optimizer
        self.device = device
        self._cuda = device.type == "cuda"
        self.copies = {id(p): HostCopy(p, pin=self._cuda) for p in offloaded}
        state = optimizer.state
        for copy in self.copies.values():  # state taken before the wrap (a step already made) moves to the host
            if copy.param in state:
                state[copy.param] = {k: _to_host(v, copy.master) for k, v in state[copy.param].items()}

    # -- the wrapped optimizer's own objects -----------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.inner.defaults

    def __repr__(self) -> str:
        total = sum(len(g["params"]) for g in self.param_groups)
        return f"OffloadedOptimizer({type(self.inner).__name__}, {len(self.copies)} of {total} parameters on the host)"

    # -- the step ----------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Run ``closure`` (if any), the update of the device parameters, then that of the host copies."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepping = [c for c in self.copies.values() if c.param.grad is not None]
        for copy in stepping:
            copy.pull(non_blocking=self._cuda)
        pulled = _record(self.device)
        with self._listing(lambda p: None if id(p) in self.copies else p):  # 1. the device's parameters
            self.inner.step()
        _wait(pulled)  # NOTE: D2H sync: the host reads the copies (after the device update was issued)
        if not stepping:
            return loss
        for copy in stepping:
            copy.land()
        masters = {id(c.param): c.master for c in stepping}
        with self._listing(lambda p: masters.get(id(p))), self._keyed_by_masters(stepping):  # 2. the host copies
            self.inner.step()
        for copy in stepping:
            copy.push(non_blocking=self._cuda)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The device gradients (the host copies are overwritten by each step)."""
        self.inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """A group added after the wrap stays on the device."""
        self.inner.add_param_group(param_group)

    # -- checkpoints: torch's form, each parameter's state loaded where it lives --------------------------------------
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """The wrapped optimizer's ``load_state_dict`` with the host copies listed in place of the offloaded
        parameters, so torch casts their state straight into host memory (never onto the device)."""
        masters = {id(c.param): c.master for c in self.copies.values()}
        params = {id(c.master): c.param for c in self.copies.values()}
        for group in self.inner.param_groups:  # in place: torch's loaded groups keep these lists
            group["params"][:] = [masters.get(id(p), p) for p in group["params"]]
        try:
            self.inner.load_state_dict(state_dict)
        finally:
            for group in self.inner.param_groups:
                group["params"][:] = [params.get(id(p), p) for p in group["params"]]
            state = self.inner.state
            for copy in self.copies.values():
                if copy.master in state:
                    state[copy.param] = state.pop(copy.master)

    # -- what lives where --------------------------------------------------------------------------------------------
    def state_bytes(self) -> StateBytes:
        """Bytes of optimizer state on the device side and on the host side, and of the host copies."""
        device = host = 0
        for param, entry in self.inner.state.items():
            size = _entry_bytes(entry)
            if id(param) in self.copies:
                host += size
            else:
                device += size
        return StateBytes(device, host, sum(c.nbytes() for c in self.copies.values()))

    @contextmanager
    def _listing(self, swap: Callable[[Tensor], Tensor | None]) -> Iterator[None]:
        """While open, each group lists ``swap(p)`` for each of its parameters ``p`` (None: left out)."""
        groups = self.inner.param_groups
        saved = [g["params"] for g in groups]
        for group, params in zip(groups, saved):
            group["params"] = [q for q in map(swap, params) if q is not None]
        try:
            yield
        finally:
            for group, params in zip(groups, saved):
                group["params"] = params

    @contextmanager
    def _keyed_by_masters(self, copies: Sequence[HostCopy]) -> Iterator[None]:
        """While open, the state of each of ``copies`` is keyed by its host copy (what the step is handed)."""
        state = self.inner.state
        for copy in copies:
            if copy.param in state:
                state[copy.master] = state.pop(copy.param)
        try:
            yield
        finally:
            for copy in copies:
                if copy.master in state:
                    state[copy.param] = state.pop(copy.master)


def state_bytes(optimizer: torch.optim.Optimizer) -> StateBytes:
    """:meth:`OffloadedOptimizer.state_bytes`, or for any other optimizer all of its state on the device side."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # Lightning's `LightningOptimizer`
    if isinstance(optimizer, OffloadedOptimizer):
        return optimizer.state_bytes()
    return StateBytes(sum(_entry_bytes(entry) for entry in optimizer.state.values()), 0, 0)


def offload(optimizer: torch.optim.Optimizer, fraction: float, device: torch.device) -> OffloadedOptimizer:
    """``optimizer`` wrapped with the state of its largest parameters, ``fraction`` of their elements, on the host."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return OffloadedOptimizer(optimizer, choose_offloaded(params, fraction), device)


def _entry_bytes(entry: Any) -> int:
    tensors = [local(v) for v in entry.values() if isinstance(v, Tensor)] if isinstance(entry, dict) else []
    return sum(t.numel() * t.element_size() for t in tensors)


def _to_host(value: Any, master: Tensor) -> Any:
    """A state value of an offloaded parameter in host memory (``step`` counters included), in the master's dtype
    where it is a floating tensor of the parameter's shape."""
    if not isinstance(value, Tensor):
        return value
    moved = value.to("cpu")
    return moved.to(master.dtype) if moved.is_floating_point() and moved.shape == master.shape else moved


def _record(device: torch.device) -> torch.cuda.Event | None:
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _wait(event: torch.cuda.Event | None) -> None:
    if event is not None:
        event.synchronize()


def describe_offload(optimizers: Sequence[torch.optim.Optimizer]) -> str:
    """One line: how many parameters (and elements) of this rank have their optimizer state and update on the host,
    of those it holds (at ``pp > 1`` the optimizer also lists the other stages' parameters, on meta)."""
    params = [
        p for optimizer in optimizers for group in optimizer.param_groups for p in group["params"] if not p.is_meta
    ]
    moved = {k for optimizer in optimizers if isinstance(optimizer, OffloadedOptimizer) for k in optimizer.copies}
    host = [p for p in params if id(p) in moved]
    total, on_host = sum(_numel(p) for p in params), sum(_numel(p) for p in host)
    return (
        f"optimizer CPU offload: the state and update of {len(host)} of {len(params)} parameters "
        f"({on_host:,} of {total:,} elements held here, {on_host / max(total, 1):.0%}) on the host"
    )


def _numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()


def offload_optimizers(
    optimizers: Sequence[torch.optim.Optimizer], fraction: float, device: torch.device
) -> list[torch.optim.Optimizer]:
    """Each of ``optimizers`` (what ``configure_optimizers`` returned) :func:`offload` ed; one that cannot be is
    refused first (the validation rule ``offload-optimizer``)."""
    raise_problems([p for optimizer in optimizers for p in check_offload_optimizer(optimizer)])
    return [offload(optimizer, fraction, device) for optimizer in optimizers]
