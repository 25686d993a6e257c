"""What one rank holds, so a loader reads exactly its part of a checkpoint, whatever layout (pp, ep, dp) wrote it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_moe_overlap.checkpoint.held import absent, held
from lightning_moe_overlap.checkpoint.keys import expert_shards, shapes_of, to_canonical
from lightning_moe_overlap.checkpoint.optimizer import param_names
from lightning_moe_overlap.moe.ep import ExpertShard


@dataclass(frozen=True)
class LoadTarget:
    """One rank's view of the live model and optimizers.

    Attributes:
        model: canonical state-dict keys of the module on this rank (dense keys, and ``name[e]`` for the experts
            held here) with their shapes (``None``: not a tensor); at pp > 1 only the keys this rank holds.
        shards: which experts each per-expert tensor holds here.
        optimizers: for each optimizer, the parameter name of each state index.
        rank: global rank.
        world_size: number of ranks.
        strict: refuse keys the model and the checkpoint do not share (``LightningModule.strict_loading``).
        absent: unsplit keys of the tensors on the meta device here (other pp ranks' chunks, :mod:`.held`) with
            their shapes; empty at pp = 1.
        order: every state-dict key of the unsplit module, in its order (what a consolidated file lists).
        param_order: every parameter name of the unsplit module, in its order.
    """

    model: dict[str, torch.Size | None]
    shards: dict[str, ExpertShard]
    optimizers: list[list[str]]
    rank: int = 0
    world_size: int = 1
    strict: bool = True
    absent: dict[str, torch.Size] = field(default_factory=dict)
    order: tuple[str, ...] = ()
    param_order: tuple[str, ...] = ()

    @classmethod
    def of(
        cls,
        module: nn.Module,
        optimizers: list[torch.optim.Optimizer] = (),  # type: ignore[assignment]
        *,
        rank: int = 0,
        world_size: int = 1,
        strict: bool = True,
    ) -> LoadTarget:
        shards = expert_shards(module)
        from lightning_moe_overlap.checkpoint.checkpointer import local_state_dict  # noqa: PLC0415 - cycle

        state = local_state_dict(module)
        return cls(
            model=shapes_of(to_canonical(held(state), shards)),
            shards=shards,
            optimizers=[param_names(opt, module) for opt in optimizers],
            rank=rank,
            world_size=world_size,
            strict=strict,
            absent=absent(state),
            order=tuple(state),
            param_order=tuple(n for n, _ in module.named_parameters()),
        )
