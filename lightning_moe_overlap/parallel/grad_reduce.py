"""Gradient reduction overlapped with the last backward (``overlap_grad_reduce``; docs/sharding.md, "Overlapped
gradient reduction").

In the sharded modes the micro-batches' gradients accumulate, unreduced, in the gathered parameters, and FSDP's
hooks are idle (``parallelize/sharding.py``). :class:`EarlyReduction` reduces each FSDP unit (the module
``fully_shard`` was applied to: a layer, an experts module, the root) as soon as its gradients are final in the
step's LAST backward, so that its reduce-scatter runs while the backward of the units before it still computes.

- The last backward runs alone (``F0, (F1|B0), ..., B[M-1]``: the schedule's cooldown phase), so nothing here runs
  inside an overlapped pair. :meth:`arm` is called just before it (``loop.py``, ``StepHooks.before_last_backward``).
  At ``pp > 1`` each held chunk (an FSDP root) has its own last backward, the last micro-batch's full backward of
  its stage, which comes after every forward of the rank (its forward precedes it in the chain of stages) and so
  runs alone too: :meth:`arm` takes the units of that root only, just before it (``pipeline/schedules.py``, the
  stages' ``before_last_backward``). The rank's later chunk finishes first, so the order below holds across them.
- When a unit's gradients are final is read from autograd: a post-accumulate-grad hook on each gathered parameter
  of the unit (hand-written: FSDP registers its own post-backward trigger in its pre-forward hook, which is kept
  idle while two contexts share the modules). A unit is final once every parameter that requires a gradient got
  one in this backward.
- The order of the collectives is fixed, not taken from the hooks: units are reduced in :attr:`order` (the
  reverse of their order in the model, i.e. the order a backward finishes them), each once every unit before it
  was reduced. A unit that gets no gradient (a module the forward does not use) holds itself and those after it
  back to :meth:`finish`, which reduces the rest in the same order, so every rank issues the same collectives in
  the same order on each process group. (A module unused on some ranks only is outside what FSDP2 supports: its
  reduce-scatter packs the parameters that hold a gradient, so the ranks' inputs would differ in size.)
- One thread, one order (where the collectives launch onto streams: NCCL). Each unit is reduced on the thread that
  runs the backward, in the hook that finds it final: that thread also issues the backward's all-to-alls, so each
  rank submits the reduce-scatters and the all-to-alls to their two communicators in one sequence, the order in
  which its autograd reaches them. Two communicators need that sequence to be the same on every rank (NCCL does not
  promise progress otherwise, least of all with one hardware queue), and it is: every rank runs the same backward
  graph in autograd's fixed order (by sequence number, gradient accumulation first), and the same units become
  final on every rank (above). FSDP's ``post_backward`` only launches onto its reduce-scatter stream, after that
  stream waited for the current one, so the backward does not wait for the reduction.
- On a lane of its own (gloo). There FSDP's reduce-scatter blocks the host until every rank is in it, so issued on
  the backward's thread it would hold the backward back to the slowest rank; a thread of its own (the reduction
  lane) runs them one by one, in the same order. Gloo keeps each process group's connections to itself, so the
  two threads' collectives cannot stall each other. :func:`blocks_the_host` chooses, from the device of the units'
  parameters, at the step's first :meth:`EarlyReduction.arm`.
- ``finish`` (the step's ``end_step``, on the calling thread) waits for the lane (gloo) and removes the hooks; the
  unit reductions left over and FSDP's end-of-backward callback then run as without the flag.
- ``before_reduce(params)``, when given, runs where the reduction runs, just before each unit's reduce-scatter, with
  the unit's gathered parameters: at ``tp > 1`` the sum of the tensor-parallel replicas' gradients over tp, which
  must precede the reduction over dp x cp (``parallelize/tensor_plan.py``, ``TensorParallelGrads``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_moe_overlap._compat import torch as torch_compat

Observer = Callable[[str, str], None]  # (event, unit name): "ready", "issue", "reduced"
BeforeReduce = Callable[[list[torch.Tensor]], None]  # a unit's gathered parameters, before its reduction


@dataclass
class _Unit:
    """One FSDP unit: its name in the model, its module, its param groups and, once armed in this step, the
    parameters still without a gradient in the armed backward (ids)."""

    name: str
    module: nn.Module
    groups: list[Any]
    pending: set[int] = field(default_factory=set)
    armed: bool = False
    issued: bool = False


class ReductionLane:
    """A thread that runs submitted jobs one at a time, in order; :meth:`drain` waits for them and re-raises the
    first error in the caller's thread."""

    def __init__(self, device: torch.device) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._errors: list[BaseException] = []
        self._device = device
        self._thread = threading.Thread(target=self._loop, name="moe-overlap-grad-reduce", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def drain(self) -> None:
        """Run out the queued jobs, end the thread; raise the first job's error."""
        self._jobs.put(None)
        self._thread.join()
        if self._errors:
            raise self._errors[0]

    def abandon(self) -> None:
        """End the thread after its queued jobs without waiting (after a failed step it may be stuck in a
        collective until the process group's timeout; it is a daemon thread)."""
        self._jobs.put(None)

    def _loop(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        while (job := self._jobs.get()) is not None:
            if self._errors:
                continue  # after a failure the rest is left to `finish`'s caller, which raises
            try:
                job()
            except BaseException as err:  # noqa: BLE001 - re-raised by `drain` in the caller's thread
                self._errors.append(err)


def blocks_the_host(device: torch.device) -> bool:
    """Whether a collective on tensors of ``device`` blocks the calling thread until every rank is in it: on CPU
    tensors torch.distributed runs gloo, whose collectives do; NCCL's (CUDA) are launched onto a stream. Where it
    blocks, the early reductions go to a lane of their own rather than the backward's thread."""
    return device.type == "cpu"


class EarlyReduction:
    """Reduces each FSDP unit of ``units`` (``(name, module)`` in the model's order) as soon as its gradients are
    final in the armed backward (module docstring). ``observer(event, unit)`` is told of each ``"ready"`` (the
    unit's gradients are final, on autograd's thread), ``"issue"`` (its turn in the order came: run on autograd's
    thread, or handed to the lane) and ``"reduced"`` (its ``post_backward`` returned, where it ran). The units of
    ``held_back`` (experts whose weight gradients are deferred, ``delay_wgrad``) are left out of the order (the same
    on every rank): they are reduced after :meth:`finish`, the other units as usual. ``on_lane``: reduce on a thread
    of its own rather than on the backward's thread; None (the default): where :func:`blocks_the_host` says so, per
    step (module docstring)."""

    def __init__(
        self, units: Sequence[tuple[str, nn.Module]], observer: Observer | None = None,
        before_reduce: BeforeReduce | None = None, held_back: Sequence[nn.Module] = (),
        on_lane: bool | None = None,
    ) -> None:  # fmt: skip
        # The reverse of the model's order: the order in which a backward finishes the units.
        self.order = [_Unit(name, m, torch_compat.fsdp_module_groups(m)) for name, m in reversed(list(units))]
        # Left out of the order: their gradients land outside autograd (deferred expert weight gradients), after
        # the parameters' hooks fired (autograd calls them with no gradient), so they are reduced after `finish`.
        held = {id(m) for m in held_back}
        self.held_back = [unit for unit in self.order if unit.groups and id(unit.module) in held]
        self.order = [unit for unit in self.order if unit.groups and id(unit.module) not in held]
        self.observer = observer
        self.before_reduce = before_reduce
        self.grad_divisor: int | None = None  # see :meth:`_divide`
        self._lock = threading.Lock()  # hooks may run on more than one autograd thread (one per device)
        self._cursor = 0
        self._handles: list[Any] = []
        self.on_lane = on_lane
        self._active = False  # between the step's first arm and finish (or reset)
        self._lane: ReductionLane | None = None

    @property
    def armed(self) -> bool:
        return self._active

    def arm(self, root: nn.Module | None = None) -> None:
        """Before a last backward (nothing else running): hook every gathered parameter of the units under ``root``
        (None: every unit), and start the lane (``on_lane``) at the step's first arm. The units' gradient sync must
        be on (``set_requires_gradient_sync(True)``). A unit not armed yet holds the ones after it back."""
        first = not self._active
        if first:
            self.reset()
        inside = None if root is None else {id(m) for m in root.modules()}
        chosen = [
            (i, u) for i, u in enumerate(self.order) if not u.armed and (inside is None or id(u.module) in inside)
        ]
        device = None
        for index, unit in chosen:
            unit.armed, unit.issued = True, False
            for param in _unsharded_params(unit):
                if not param.requires_grad:
                    continue
                device = device or param.device
                unit.pending.add(id(param))
                self._handles.append(param.register_post_accumulate_grad_hook(self._hook(index)))
        if first:
            self._cursor = 0
            self._active = True
            device = device or torch.device("cpu")
            lane = blocks_the_host(device) if self.on_lane is None else self.on_lane
            self._lane = ReductionLane(device) if lane else None
        with self._lock:
            self._issue_ready()  # units without a parameter that takes a gradient

    def finish(self) -> None:
        """After the last backward: wait for the reductions issued on the lane, remove the hooks. Raises the lane's
        first error. The units not issued are left to FSDP's end of step (``ShardedModel.end_step``), in model
        order, their gradients divided first (:meth:`_divide`)."""
        lane, self._lane, self._active = self._lane, None, False
        self._remove_hooks()
        if lane is not None:
            lane.drain()
        for unit in [*self.order, *self.held_back]:
            if not unit.issued:
                self._divide(_unsharded_params(unit))
            unit.issued = False

    def _divide(self, params: list[torch.Tensor]) -> None:
        """At ``pp > 1`` torch's schedule divides every gradient by the micro-batch count after its last backward
        (``scale_grads``), which would come after (or, on another thread, during) these reductions; with
        ``grad_divisor`` set the strategy turns torch's division off and each unit's gradients get the same
        ``div_`` here, just before its reduction (``pipeline/pipelined.py``)."""
        if self.grad_divisor is None or self.grad_divisor == 1:
            return
        for param in params:
            if param.grad is not None:
                param.grad.div_(self.grad_divisor)

    def reset(self) -> None:
        """Drop what a failed step left armed, without waiting for it (that step has raised its error)."""
        lane, self._lane, self._active = self._lane, None, False
        self._remove_hooks()
        if lane is not None:
            lane.abandon()
        for unit in [*self.order, *self.held_back]:
            unit.pending.clear()
            unit.armed = unit.issued = False

    # -- on autograd's thread ------------------------------------------------------------------------------------
    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def landed(param: torch.Tensor) -> None:
            with self._lock:
                unit = self.order[index]
                if unit.issued:
                    raise RuntimeError(
                        f"`overlap_grad_reduce`: a gradient of FSDP unit {unit.name!r} landed after the unit was "
                        "reduced in the last backward (a parameter whose gradient accumulates twice in one backward, "
                        "e.g. used both inside and outside a reentrant `torch.utils.checkpoint`). Its reduction would "
                        "miss that part. Use `use_reentrant=False`, or set `overlap_grad_reduce=False`."
                    )
                unit.pending.discard(id(param))
                if not unit.pending:
                    self._tell("ready", unit.name)
                    self._issue_ready()

        return landed

    def _issue_ready(self) -> None:
        """Issue, in order, every unit from the cursor on whose gradients are final (lock held): to the lane, or
        run here, on the backward's thread."""
        assert self._active
        while self._cursor < len(self.order) and self._final(self.order[self._cursor]):
            unit = self.order[self._cursor]
            unit.issued = True
            self._cursor += 1
            self._tell("issue", unit.name)
            if self._lane is not None:
                self._lane.submit(self._reduction(unit, _ready_event(unit)))
            else:
                self._reduction(unit, None)()

    @staticmethod
    def _final(unit: _Unit) -> bool:
        return unit.armed and not unit.pending

    def _reduction(self, unit: _Unit, event: Any) -> Callable[[], None]:
        def reduce() -> None:
            if event is not None:  # the gradients were produced on another thread's stream
                torch.cuda.current_stream().wait_event(event)
            params = _unsharded_params(unit)
            self._divide(params)
            if self.before_reduce is not None:
                self.before_reduce(params)
            for group in unit.groups:
                torch_compat.fsdp_reduce_group(group)
            self._tell("reduced", unit.name)

        return reduce

    def _tell(self, event: str, name: str) -> None:
        if self.observer is not None:
            self.observer(event, name)

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _unsharded_params(unit: _Unit) -> list[torch.Tensor]:
    return [p for group in unit.groups for p in torch_compat.fsdp_group_unsharded_params(group)]


def _ready_event(unit: _Unit) -> Any:
    """On CUDA, an event on this thread's current stream (where autograd just accumulated the unit's last
    gradient); None elsewhere."""
    params = _unsharded_params(unit)
    if params and params[0].device.type == "cuda":
        return torch.cuda.current_stream(params[0].device).record_event()
    return None
