"""What the memory callbacks share: attach to the model's decoder layers when training starts, detach at teardown.

``apply`` takes the model, or a list of modules: a pipeline rank's chunks (``split_model``'s chunk modules, which
hold the model's own layers). One ``apply`` covers every chunk of the list, and a second ``apply`` replaces the
first, so a rank's chunks are attached with one call. Layers are found in each chunk as in a model; per-layer
options that count layers (full recompute's units and ``block`` count) apply per chunk, as Megatron applies them
per (virtual) pipeline stage: a chunk's first layer receives its input from another chunk, never straight from the
previous layer, so a unit never spans two chunks.

Everything a callback installs (a forward hook, a stage wrapper, a wrapped ``forward``) comes with a handle whose
``remove()`` undoes it; the callback keeps them and removes them in reverse order. Each kind of handle removes only
its own entry, so two callbacks on the same module come off in any order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_moe_overlap.callbacks._name_checks import no_layers_error
from lightning_moe_overlap.callbacks.layer_specs import Layer, find_layers
from lightning_moe_overlap.parallel.dtensors import local

Target = nn.Module | Sequence[nn.Module]  # a model, or a pipeline rank's chunks


class Handle(Protocol):
    def remove(self) -> None: ...


class LayerCallback(Callback):
    """Base of ``SelectiveRecompute`` and ``ActivationOffload``: ``apply`` at fit start, ``remove`` at teardown."""

    owner = "`LayerCallback`"

    def __init__(self) -> None:
        super().__init__()
        self._handles: list[Handle] = []

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Attach to the module, or at ``pp > 1`` to the chunks this rank holds (``strategy.pipeline_chunks``), and
        log on rank 0 what was attached there."""
        chunks = getattr(trainer.strategy, "pipeline_chunks", None)
        self.apply(list(chunks) if chunks else pl_module)
        where = f"the {len(chunks)} pipeline chunks rank 0 holds" if chunks else "the model"
        rank_zero_info(f"{self!r}: {len(self._handles)} regions attached to {where}.")

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.remove()

    def apply(self, model: Target) -> object:
        raise NotImplementedError

    def remove(self) -> None:
        """Undo everything this callback installed."""
        for handle in reversed(self._handles):
            handle.remove()
        self._handles = []

    def _layers(self, model: Target) -> list[list[Layer]]:
        """The decoder layers of each part of ``model`` (one part: a module; several: a list of chunks), after
        removing what an earlier ``apply`` installed.

        Raises:
            TypeError: ``model`` is neither a module nor a non-empty list of modules.
            ValueError: no part has a recognised decoder layer (a chunk without layers is fine).
        """
        self.remove()
        per_part = [find_layers(part) for part in parts(self.owner, model)]
        if not any(per_part):
            raise no_layers_error(self.owner, model)
        return per_part


def parts(owner: str, model: Target) -> list[nn.Module]:
    """``[model]`` for a module, the modules of a list or tuple of chunks."""
    if isinstance(model, nn.Module):
        return [model]
    if isinstance(model, (list, tuple)) and model and all(isinstance(m, nn.Module) for m in model):
        return list(model)
    raise TypeError(
        f"{owner}.apply: got {type(model).__name__} {model!r:.80}; it takes the model (an `nn.Module`) or a non-empty "
        "list of modules (a pipeline rank's chunks). Pass the model, or the list of this rank's chunk modules."
    )


def parameters_and_buffers(model: Target) -> list:
    """Every parameter and buffer of every part (never offloaded), ``DTensor``s as their local shards (the memory
    that the experts' kernels save for backward)."""
    return [local(t) for part in parts("", model) for t in (*part.parameters(), *part.buffers())]
