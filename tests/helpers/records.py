"""Test oracles that watch from outside the code under test: log records, and the experts each router chose."""

from __future__ import annotations

import logging

import torch
from torch import nn


class LogRecords(logging.Handler):
    """Keeps the message of every record that reaches it (attach it to the logger under test)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def record_routing(model: nn.Module) -> dict[int, list[torch.Tensor]]:
    """The top-k expert indices of every training forward of each of ``model.layers``' routers (``mlp.gate``), as
    forward hooks see them: an independent count of where the tokens went."""
    routed: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(model.layers))}
    for i, layer in enumerate(model.layers):
        def keep(module, args, output, i=i):  # noqa: ANN001
            if module.training:
                routed[i].append(output[2].detach().clone())
        layer.mlp.gate.register_forward_hook(keep)
    return routed
