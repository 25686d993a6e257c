"""A LightningModule's model cut into this rank's pipeline chunks and run as torch stages (``MoEOverlapStrategy`` at
``pp > 1``).

What the strategy does with it, in order (docs/pipeline.md, "With the strategy")::

    pipelined = PipelinedModel.cut(module, config, groups)  # layout, split, which chunks this rank holds
    pipelined.place(device, seed)                 # own chunks allocated (seeded init if built on meta), others on meta
    handle.apply(config, groups, runtime, modules=pipelined.held_chunks)   # experts of own chunks expert-parallel
    (the strategy places with ``materialize=False`` and allocates the held tensors itself: parallelize/steps.py)
    pipelined.build_schedule(engine, context)     # torch stages of own chunks, the schedule, the overlap executor
    loss = pipelined.train_step(batch, logs)      # one optimizer step's forwards and backwards
    loss = pipelined.eval_step(batch, logs)       # forward only (validation, test)

The model object stays the unsplit one (chunks share its modules), so the LightningModule's state-dict keys are the
unsplit model's at any ``pp``; the tensors of chunks other pp ranks hold are on the meta device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_moe_overlap.config import OverlapConfig
from lightning_moe_overlap.config.pipeline_layout import PipelineLayout, build_layout
from lightning_moe_overlap.loop import split_batch
from lightning_moe_overlap.loss.tokens import StepTokens, TokenScope
from lightning_moe_overlap.overlap.engine import OverlapEngine
from lightning_moe_overlap.parallel import ParallelGroups
from lightning_moe_overlap.pipeline.executor import PipelineExecutor
from lightning_moe_overlap.pipeline.report import placement_for
from lightning_moe_overlap.pipeline.schedules import DeferredWgrad, build_schedule, build_stages
from lightning_moe_overlap.pipeline.split import SplitModel, split_model
from lightning_moe_overlap.pipeline.splitters import count_layers
from lightning_moe_overlap.pipeline.step_loss import StepLoss
from lightning_moe_overlap.step_logs import MicroBatchLogs

ContextFactory = Callable[[], AbstractContextManager]
LastBackward = Callable[[nn.Module], None]  # (held chunk): just before its last full backward of an optimizer step


class _InContext(nn.Module):
    """A chunk whose forward runs inside ``context()`` (the precision plugin's autocast), on whichever thread runs it:
    autocast state is thread-local, and the overlapped pair runs chunks on the engine's two threads."""

    def __init__(self, chunk: nn.Module) -> None:
        super().__init__()
        self.chunk = chunk
        self.context: ContextFactory = nullcontext

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.context():
            return self.chunk(*args, **kwargs)


class PipelinedModel:
    """This rank's chunks of a split model, with the schedule that runs them. Build it with :meth:`cut`."""

    def __init__(self, split: SplitModel, config: OverlapConfig, groups: ParallelGroups) -> None:
        self.split = split
        self.config = config
        self.groups = groups
        self.schedule_name = config.resolved_schedule
        self.held = split.chunk_indices_of_rank(groups.coords.pp)
        self._wrapped = [_InContext(split.chunks[c]) for c in self.held]
        self.device = torch.device("cpu")  # where the chunks live, set by place()
        self._train: PipelineExecutor | None = None
        self._train_loss: StepLoss | None = None  # the training schedule's loss function
        self._eval: Any = None  # a plain schedule over separate stage objects, built at the first eval step
        self._before_last_backward: LastBackward | None = None
        self._deferred_wgrad: DeferredWgrad | None = None  # with delay_wgrad: each stage's weight work (schedules.py)
        self.grad_divisor: int | None = None  # with before_last_backward: M where torch would divide, else None
        self.schedule_divisor = 1  # what torch's schedule divides the gradients by after a training step
        self._ends_step = True  # whether the running train_step's batch is the optimizer step's last

    @classmethod
    def cut(cls, module: nn.Module, config: OverlapConfig, groups: ParallelGroups) -> PipelinedModel:
        """Cut ``module`` into ``pp * vpp`` chunks per ``config`` (``split_model``'s rules say who cuts it)."""
        layout = build_layout(
            count_layers(module), config.pp, config.resolved_vpp, config.pipeline_layout,
            placement=placement_for(config.resolved_schedule),
        )  # fmt: skip
        return cls(split_model(module, layout), config, groups)

    @property
    def layout(self) -> PipelineLayout:
        return self.split.layout

    @property
    def held_chunks(self) -> list[nn.Module]:
        return [self.split.chunks[c] for c in self.held]

    @property
    def holds_first(self) -> bool:
        return 0 in self.held

    @property
    def holds_last(self) -> bool:
        return self.layout.num_chunks - 1 in self.held

    # -- memory: own chunks on the device, the others on meta ------------------------------------------------------
    def place(self, device: torch.device, seed: int, *, materialize: bool = True) -> None:
        """Allocate this rank's chunks on ``device`` and free the others (meta).

        A model built on the meta device (``configure_model`` runs under it) gets its chunks initialised with
        :func:`~lightning_moe_overlap.pipeline.split.seeded_init` under ``seed`` (values equal on every rank and
        equal to ``seeded_init`` of the unsplit model); a model built with values keeps them. With
        ``materialize=False`` the held tensors on meta stay there (the strategy allocates them afterwards, the
        experts as this rank's slice only: ``parallelize/materialize.py``). Tensors of the module outside every chunk
        move to ``device``.
        """
        self.device = torch.device(device)
        held_tensors = {id(t) for chunk in self.held_chunks for t in _tensors(chunk)}
        if materialize and any(t.is_meta for chunk in self.held_chunks for t in _tensors(chunk)):
            self.split.materialize(self.held, device, seed=seed)
            held_tensors = {id(t) for chunk in self.held_chunks for t in _tensors(chunk)}
        in_chunks = {id(t) for chunk in self.split.chunks for t in _tensors(chunk)}
        for owner, name, tensor in _owned_tensors(self.split.model):
            if tensor.is_meta and id(tensor) in held_tensors and not materialize:
                continue
            if id(tensor) in held_tensors or id(tensor) not in in_chunks:
                _move(owner, name, tensor, device)
            else:
                _move(owner, name, tensor, torch.device("meta"))

    # -- schedules ---------------------------------------------------------------------------------------------------
    def build_schedule(
        self, engine: OverlapEngine | None, device: torch.device, tokens: TokenScope, *, accumulate: int = 1,
        before_last_backward: LastBackward | None = None,
    ) -> None:  # fmt: skip
        """torch stages over this rank's chunks and the training schedule (pairs run by ``engine`` when it overlaps),
        for ``accumulate`` batches per optimizer step: torch divides the gradients by the micro-batch count after the
        step only when that is all (micro-batch means, no accumulation); otherwise each loss is weighted
        (``step_loss.py``). ``before_last_backward(chunk)`` runs just before each held chunk's last full backward of
        an optimizer step (the sharded modes' early reduction), in the batch :meth:`train_step` is told ends it; its
        reductions would come before torch's division of the gradients after the step, so torch's is then off and
        :attr:`grad_divisor` says what the caller divides each gradient by before its reduction. With ``delay_wgrad``
        the experts' weight-gradient GEMMs queued by a stage backward are that stage's weight work
        (``build_stages``' ``deferred_wgrad``): at the end of a full backward, in the weight action of a split one."""
        self._before_last_backward = before_last_backward
        if self.config.delay_wgrad and engine is not None:
            self._deferred_wgrad = DeferredWgrad(engine.runtime.deferred_wgrad, engine.runtime.wgrad_kept)
        overlap = engine is not None and engine.overlap
        scale = not self.split.token_loss and accumulate == 1
        mean_weight = 1.0 / (self.config.num_microbatches * accumulate)
        weight = None if scale else (1.0 if self.split.token_loss else mean_weight)
        self._train_loss = StepLoss(self.split.loss_fn, tokens, token_loss=self.split.token_loss, weight=weight)
        early = before_last_backward is not None
        self.grad_divisor = self.config.num_microbatches if scale and early else None
        # what torch's schedule divides the parameters' gradients by after the step (1: it does not divide)
        self.schedule_divisor = self.config.num_microbatches if scale and not early else 1
        schedule = self._schedule(device, overlap=overlap, loss_fn=self._train_loss, scale_grads=scale and not early,
                                  train=True)  # fmt: skip
        self._train = PipelineExecutor(schedule, engine)

    def _schedule(
        self, device: torch.device, *, overlap: bool, loss_fn: Any, scale_grads: bool = True, train: bool = False
    ) -> Any:
        hook = self._last_backward if train and self._before_last_backward is not None else None
        deferred = self._deferred_wgrad if train else None
        stages = build_stages(self._wrapped, self.held, self.layout.num_chunks, self.groups.pp, device, hook,
                              deferred_wgrad=deferred)  # fmt: skip
        return build_schedule(
            self.schedule_name, stages, self.config.num_microbatches, loss_fn, overlap=overlap, scale_grads=scale_grads
        )

    def _last_backward(self, stage_index: int) -> None:
        if self._ends_step and self._before_last_backward is not None:
            self._before_last_backward(self.split.chunks[stage_index])

    # -- steps -------------------------------------------------------------------------------------------------------
    def train_step(
        self, batch: Any, logs: MicroBatchLogs, context: ContextFactory, *,
        tokens: StepTokens | None = None, token_loss: Callable[[Tensor], Tensor] | None = None, ends_step: bool = True,
    ) -> StepResult:  # fmt: skip
        """One batch's forwards and backwards: its loss and what the last stage logged, the same on every rank of the
        pipeline. The loss is the mean over the micro-batches, or with a token loss (``tokens``, the window's count)
        ``token_loss(the batch's token sum on this rank)``. ``ends_step``: the batch is the optimizer step's last
        (of an accumulation window), whose last backwards are the step's."""
        if self._train is None or self._train_loss is None:
            raise RuntimeError("PipelinedModel.train_step before build_schedule(); the strategy builds it in setup.")
        args, target, kwargs = self._inputs(batch)
        self._train_loss.losses = []
        self._ends_step = ends_step
        with _forward_context(self._wrapped, context), logs:
            self._train.step(*args, target=target, **kwargs)
        losses = self._train_loss.losses
        if not (self.split.token_loss and self.holds_last and tokens is not None and token_loss is not None):
            return self._share(losses, logs)
        token_sum = torch.stack([l.detach().float() for l in losses]).sum() * tokens.divisor
        loss = token_loss(token_sum)  # collective over the last stage's dp group with token_mean_over_dp
        return self._share(losses, logs, loss=loss)

    def eval_step(self, batch: Any, logs: MicroBatchLogs, context: ContextFactory, device: torch.device) -> StepResult:
        """The forwards of one batch (no backward), as :meth:`train_step` reports them. The first call builds a
        plain schedule over separate stage objects (torch's ``eval``; the training schedule's pairs need backwards)."""
        if self._eval is None:
            self._eval = self._schedule(device, overlap=False, loss_fn=self.split.loss_fn)
        args, target, kwargs = self._inputs(batch)
        losses: list[Tensor] = []
        with _forward_context(self._wrapped, context), logs:
            self._eval.eval(*args, target=target, losses=losses, **kwargs)
        return self._share(losses, logs)

    def _inputs(self, batch: Any) -> tuple[tuple[Tensor, ...], Tensor | None, dict[str, Tensor]]:
        """The first chunk's inputs (on the rank holding it), the loss target (on the rank holding the last) and
        the keyword tensors every chunk takes (on every rank). Every pp rank reads the same batch, so a batch the
        splitter refuses raises on all of them, before any stage runs."""
        args, target, kwargs = self.split.step_inputs(batch)
        split_batch((args, target, kwargs), self.config.num_microbatches)  # the micro-batch rule, with its message
        return (args if self.holds_first else ()), (target if self.holds_last else None), kwargs

    def _share(self, losses: list[Tensor], logs: MicroBatchLogs, loss: Tensor | None = None) -> StepResult:
        """The step's loss (``loss``, or the mean of ``losses``) and the values logged on the last stage (a value
        logged as each micro-batch's loss: the step's loss), sent to every rank of the pp group."""
        payload = None
        if self.holds_last:
            if loss is None:
                payload = StepResult(torch.stack([l.detach().float() for l in losses]).mean(), logs.summary())
            else:
                payload = StepResult(loss, logs.summary(loss_of=(losses, loss)))
        pp_group = self.groups.pp
        if dist.get_world_size(pp_group) > 1:
            holder = [None if payload is None else payload.to(torch.device("cpu"))]
            dist.broadcast_object_list(holder, src=dist.get_global_rank(pp_group, self.layout.chunks[-1].rank),
                                       group=pp_group)  # fmt: skip
            payload = holder[0].to(self.device)
        assert payload is not None
        return payload


@dataclass(frozen=True)
class StepResult:
    """What a pipeline step reports on every rank: the mean loss over its micro-batches and the logged values."""

    loss: Tensor
    logs: list[tuple[str, Any, tuple, dict]]

    def to(self, device: torch.device) -> StepResult:
        def move(value: Any) -> Any:
            return value.to(device) if isinstance(value, Tensor) else value

        return StepResult(move(self.loss), [(n, move(v), a, k) for n, v, a, k in self.logs])


@contextmanager
def _forward_context(wrapped: Sequence[_InContext], context: ContextFactory) -> Iterator[None]:
    """The chunks' forwards run inside ``context`` for one step."""
    for w in wrapped:
        w.context = context
    try:
        yield
    finally:
        for w in wrapped:
            w.context = nullcontext


def _tensors(module: nn.Module) -> Iterator[Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def _owned_tensors(module: nn.Module) -> Iterator[tuple[nn.Module, str, Tensor]]:
    """(owner module, name, tensor) for every parameter and buffer, each once."""
    seen: set[int] = set()
    for owner in module.modules():
        for name, tensor in [*owner.named_parameters(recurse=False), *owner.named_buffers(recurse=False)]:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                yield owner, name, tensor


def _move(owner: nn.Module, name: str, tensor: Tensor, device: torch.device) -> None:
    if tensor.device == device:
        return
    if tensor.is_meta and device.type != "meta":
        raise RuntimeError(
            f"{type(owner).__name__}.{name} is on the meta device and belongs to no pipeline chunk, so nothing "
            "initialises it. Rule: at pp > 1 every tensor built on meta is part of a chunk. Fix: build it outside "
            "the meta device (in __init__), or make it part of a chunk."
        )
    with torch.no_grad():
        moved = tensor.to(device)
    if device.type != "meta":  # between devices: the same object, so references to it stay valid (as Module.to)
        tensor.data = moved
        return
    if isinstance(tensor, nn.Parameter):  # to meta a tensor cannot keep its object: a meta one replaces it
        owner.register_parameter(name, nn.Parameter(moved, requires_grad=tensor.requires_grad))
    else:
        owner.register_buffer(name, moved, persistent=name not in _non_persistent(owner))


def _non_persistent(owner: nn.Module) -> set[str]:
    persistent = set(owner.state_dict(keep_vars=True).keys())
    return {name for name, _ in owner.named_buffers(recurse=False) if name not in persistent}
