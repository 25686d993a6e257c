"""What the memory callbacks share: attach to the model's decoder layers when training starts, detach at teardown.

Everything a callback installs (a forward hook, a stage wrapper, a wrapped ``forward``) comes with a handle whose
``remove()`` undoes it; the callback keeps them and removes them in reverse order. Each kind of handle removes only
its own entry, so two callbacks on the same module come off in any order.
"""

from __future__ import annotations

from typing import Protocol

from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from typing_extensions import override

from lightning_moe_overlap.callbacks.names import Layer, find_layers
from lightning_moe_overlap.callbacks.validation import no_layers_error


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
        self.apply(pl_module)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.remove()

    def apply(self, model: nn.Module) -> object:
        raise NotImplementedError

    def remove(self) -> None:
        """Undo everything this callback installed."""
        for handle in reversed(self._handles):
            handle.remove()
        self._handles = []

    def _layers(self, model: nn.Module) -> list[Layer]:
        """The decoder layers of ``model``, after removing what an earlier ``apply`` installed."""
        self.remove()
        layers = find_layers(model)
        if not layers:
            raise no_layers_error(self.owner, model)
        return layers
