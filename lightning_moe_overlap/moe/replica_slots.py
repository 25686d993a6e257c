"""Replica slots of an experts module: copies of hot experts kept beside its parameters (``moe/placement.py``).

With ``R`` replicas over ep ranks, each rank computes ``E / ep + R / ep`` local experts: its parameter rows (the
primaries) followed by its replica rows. The replica rows are plain leaf tensors of this module, not parameters:
they are not in the state dict, the optimizer or ``fully_shard``'s care. Their values are copies of the primaries'
(``parallelize/expert_placer.py`` refreshes them after every optimizer step), and their gradients are added to the
primaries' before the gradients are reduced, so the optimizer steps each logical expert once, with the gradient of
all its tokens: the model trained is the one without replicas.

The dispatch routes to ``E + R`` slots: a dispatcher of the module's kind built for that many (contiguous blocks of
``(E + R) / ep`` per rank), fed by :meth:`ExpertPlacement.to_copies`.

Shape legend: E experts, R replicas, T tokens, K top-k.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_moe_overlap.moe.dispatch.base import DispatcherBase
from lightning_moe_overlap.moe.dispatch.factory import build_dispatcher
from lightning_moe_overlap.moe.placement import ExpertPlacement
from lightning_moe_overlap.parallel.dtensors import local


class ReplicaSlots:
    """The replica rows of one experts module under ``placement`` (which has replicas), and their dispatch.

    Args:
        placement: the module's placement, with ``placement.replicas``.
        dispatcher: the module's own dispatcher (its kind, group, runtime and knobs are reused for ``E + R``).
        parameters: ``{name: parameter}`` of the module's per-expert parameters (their local rows give the shapes,
            dtypes and device; a replica needs a gradient where its parameter does).
    """

    def __init__(self, placement: ExpertPlacement, dispatcher: DispatcherBase, parameters: dict[str, Tensor]) -> None:
        self.placement = placement
        self.num_slots = placement.num_experts + len(placement.replicas)
        knobs = {knob: getattr(dispatcher, knob) for knob in dispatcher.knobs}
        self.dispatcher = build_dispatcher(dispatcher.name, dispatcher.ep_group, self.num_slots, dispatcher.runtime,
                                           **knobs)  # fmt: skip
        device = local(next(iter(parameters.values()))).device
        self.copies_EC, self.num_E = placement.copy_table(device)
        per_rank = placement.replicas_per_rank
        self.routes: dict[int, tuple] = {}  # the placer's exchange routes per parameter, for this placement
        self.rows: dict[str, Tensor] = {}
        for name, param in parameters.items():
            shape, dtype = local(param).shape, param.dtype
            rows = torch.zeros(per_rank, *shape[1:], dtype=dtype, device=device)
            self.rows[name] = rows.requires_grad_(param.requires_grad)

    @property
    def local_slots(self) -> int:
        """Experts this rank computes: its primaries and its replicas."""
        return self.dispatcher.num_local_experts

    def route(self, indices_TK: Tensor) -> Tensor:
        """The router's logical choices as dispatch slots (no host read)."""
        return ExpertPlacement.to_copies(indices_TK, self.copies_EC, self.num_E, self.num_slots)

    def weight(self, name: str, primaries: Tensor) -> Tensor:
        """The rows the local experts compute with: ``primaries`` (this rank's parameter rows), then the replicas'."""
        return torch.cat([primaries, self.rows[name]])
