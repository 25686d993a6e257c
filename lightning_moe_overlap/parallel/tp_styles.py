"""Tensor parallelism's pieces on torch's engine: applying a plan (``parallelize_module`` over ``mesh["tp"]``) so
that a linear swapped in later is parallelized the same way, the sequence check of sequence parallelism, and the
LM head's vocabulary-parallel style. Which plan a model gets is ``parallelize/tensor_plan.py``."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, parallelize_module

PLANNED_ATTR = "tensor_parallel_planned"  # on each linear the plan parallelized: its `PlannedLinear`


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
                f"`MoEOverlapStrategy(tp={self.tp})`: `{self.name}` got a sequence of {first.shape[1]} tokens (input "
                f"shape {tuple(first.shape)}), which tp={self.tp} does not divide. Rule: with sequence parallelism "
                f"each tp rank holds S / tp tokens. Fix: make the sequence length a multiple of {self.tp} (pad the "
                "batch, or choose the data's sequence length so)."
            )


def vocab_parallel_head() -> ColwiseParallel:
    """The LM head's style: gather the sequence-parallel input, keep the logits sharded by vocabulary (a
    ``Shard(-1)`` ``DTensor``, for the loss-parallel cross-entropy)."""
    return ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
