"""Tensor parallelism's pieces on torch's engine: applying a plan (``parallelize_module`` over ``mesh["tp"]``) so
that a linear swapped in later is parallelized the same way, the sequence check of sequence parallelism, the LM
head's vocabulary-parallel style, and the style of a replica whose gradient is whole on every tp rank (multi-head
latent attention's down-projections). Which plan a model gets is ``parallelize/tensor_plan.py``."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, parallelize_module

PLANNED_ATTR = "tensor_parallel_planned"  # on each linear the plan parallelized: its `PlannedLinear`
WHOLE_GRADIENT_ATTR = "tensor_parallel_whole_gradient"  # on each module a `WholeGradientReplica` styled


def apply_tensor_parallel(module: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, ParallelStyle]) -> None:
    """``parallelize_module(module, tp_mesh, plan)``, each rank keeping its own shard of the tensors it already holds
    (equal on every tp rank: no data is sent)."""
    for style in plan.values():
        if hasattr(style, "src_data_rank"):
            style.src_data_rank = None  # every tp rank holds the same values: take the local shard, send nothing
    parallelize_module(module, tp_mesh, dict(plan))
    tp = tp_mesh.size()
    cutting = [pattern for pattern, style in plan.items() if _cuts_sequence(style)]
    for name, sub in module.named_modules():
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in cutting):
            sub.register_forward_pre_hook(_SequenceCheck(name, tp), prepend=True)  # before the style's own
        styles = [style for pattern, style in plan.items() if fnmatch.fnmatchcase(name, pattern)]
        if isinstance(sub, nn.Linear) and styles:
            setattr(sub, PLANNED_ATTR, PlannedLinear(name, styles[-1], tp_mesh))


@dataclass(frozen=True)
class PlannedLinear:
    """A linear the plan parallelized, kept on it (attribute :data:`PLANNED_ATTR`) so that a module swapped in for it
    afterwards (FP8: torchao's ``Float8Linear`` holding the same ``DTensor`` weight, ``fp8/dense.py``) is parallelized
    the same way: the style's input and output hooks, and the sequence check, belong to the module object."""

    name: str
    style: ParallelStyle
    tp_mesh: DeviceMesh

    def apply_to(self, linear: nn.Module) -> None:
        """Parallelize ``linear`` (whose parameters are already this plan's ``DTensor`` shards: they are kept) with
        the style, as :func:`apply_tensor_parallel` did the module it replaces."""
        parallelize_module(linear, self.tp_mesh, self.style)
        if _cuts_sequence(self.style):
            linear.register_forward_pre_hook(_SequenceCheck(self.name, self.tp_mesh.size()), prepend=True)
        setattr(linear, PLANNED_ATTR, self)


def _cuts_sequence(style: ParallelStyle) -> bool:
    """Whether ``style`` puts its module's activations onto the sequence dimension (``Shard(1)``)."""
    layouts = [*(getattr(style, "output_layouts", None) or ()), *(getattr(style, "desired_input_layouts", None) or ())]
    return any(isinstance(layout, Shard) and layout.dim == 1 for layout in layouts)


@dataclass(frozen=True)
class _SequenceCheck:
    """A forward pre-hook: the sequence (dimension 1 of the first input) splits evenly over the tp ranks."""

    name: str
    tp: int

    def __call__(self, module: nn.Module, args: tuple) -> None:
        first = args[0] if args else None
        if isinstance(first, Tensor) and first.dim() >= 2 and first.shape[1] % self.tp:
            raise ValueError(
                f"`MoEOverlapStrategy(tp={self.tp})` (rule `tp-divides-sequence`, docs/validation.md): `{self.name}` "
                f"got a sequence of {first.shape[1]} tokens (input shape {tuple(first.shape)}), which tp={self.tp} "
                f"does not divide. Rule: with sequence parallelism each tp rank holds S / tp tokens of the model's "
                f"input (after the model's own shift of its targets, if any). Fix: make that length a multiple of "
                f"{self.tp} (pad the batch, or choose the data's sequence length so)."
            )


def vocab_parallel_head() -> ColwiseParallel:
    """The LM head's style: gather the sequence-parallel input, keep the logits sharded by vocabulary (a
    ``Shard(-1)`` ``DTensor``, for the loss-parallel cross-entropy)."""
    return ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)


class WholeGradientReplica(ParallelStyle):
    """A module the plan leaves whole that runs in the tp-replicated region (the whole sequence, every head) and
    feeds only column-wise layers, whose backward sums their input's gradient over tp: its output's gradient, and
    so its parameters', are then whole and equal on every tp rank. It is marked (:data:`WHOLE_GRADIENT_ATTR`) so
    that the strategy does not sum those gradients over tp again (``TensorParallelGrads``).

    Multi-head latent attention (DeepSeek-V2/V3) has such modules before its up-projections: ``q_a_proj``,
    ``q_a_layernorm``, ``kv_a_layernorm``, and ``kv_a_proj_with_mqa``, whose last ``rope_dim`` output columns
    (the rotary key shared by all heads) go to the attention directly: each tp rank's heads give only their part of
    that slice's gradient, so it is summed over tp in the backward here (Hugging Face's ``mla_kv_a_proj`` style)."""

    def __init__(self, rope_dim: int | None = None) -> None:
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        setattr(module, WHOLE_GRADIENT_ATTR, True)
        if self.rope_dim:
            module.register_forward_hook(_RopeGradientSum(self.rope_dim, device_mesh.get_group()))
        return module


@dataclass(frozen=True)
class _RopeGradientSum:
    """A forward hook: the output's last ``rope_dim`` columns get their gradient summed over ``group``."""

    rope_dim: int
    group: ProcessGroup

    def __call__(self, module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        kept, rope = output.split([output.shape[-1] - self.rope_dim, self.rope_dim], dim=-1)
        return torch.cat([kept, _SumGradient.apply(rope, self.group)], dim=-1)


class _SumGradient(torch.autograd.Function):
    """The identity forward; the gradient summed over ``group`` backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
