"""The run's expert placement: count what each expert receives, re-place the experts, keep checkpoints logical.

:class:`ExpertPlacer` acts on the experts modules this rank holds (at ``pp > 1``, its own chunks'), each with a
placement of its own (``moe/placement.py``). It counts the tokens routed to each logical expert during training
forwards (on the device, at the experts' input, as the expert-bias update does: a recompute is not counted), and at
a step boundary :meth:`ExpertPlacer.rebalance` sums the counts over the ranks that see distinct tokens, chooses each
module's balanced placement and moves the rows of its parameters, gradients and optimizer state in one exchange
(``moe/expert_moves.py``). Every rank of a pp stage decides on the same summed counts, so they agree without
another message.

Checkpoints stay logical: :meth:`ExpertPlacer.to_logical` moves every module back to the identity before a state
dict is taken, and :meth:`ExpertPlacer.restore` moves it to the chosen placement again once the checkpoint is
written (or staged, for a background save); a load first drops the placement. The results do not depend on the
placement (docs/expert_placement.md, "What stays bitwise"), so a run interrupted between the two moves is still
correct: it only runs on the identity until the next re-placement.

Under ``fully_shard`` (``shard="optimizer"`` / ``"full"``) the experts modules are resharded before a move, so
that their parameters are the sharded ones the optimizer holds, and gathered again afterwards in ``"optimizer"``
mode (full parameters at rest).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from lightning_moe_overlap.moe.ep import ExpertParallelExperts
from lightning_moe_overlap.moe.expert_moves import LayerMove, MoveReport, move_rows
from lightning_moe_overlap.moe.placement import ExpertPlacement, balanced_placement
from lightning_moe_overlap.moe.router import _in_training_forward
from lightning_moe_overlap.parallelize.sharding import ShardedModel

Optimizers = Sequence[torch.optim.Optimizer]


@dataclass(frozen=True)
class LayerPlacementReport:
    """One experts module at a re-placement: the most loaded ep rank's tokens over the mean before and after
    (on the counted window), and how many experts changed rank."""

    name: str
    imbalance_before: float
    imbalance_after: float
    moved_experts: int


@dataclass(frozen=True)
class PlacementReport:
    """One re-placement: the global step it followed, each module's report, and this rank's move."""

    step: int
    layers: tuple[LayerPlacementReport, ...]
    move: MoveReport


class ExpertPlacer:
    """Placements of the experts modules this rank holds, and the moves between them.

    Args:
        model: the model (for the modules' names).
        modules: the expert-parallel experts modules this rank holds, in model order.
        sharded: the model's ``fully_shard`` record (the experts are resharded around a move).
        group: the ranks that see distinct tokens of these modules (the counts are summed over it).

    The moves take the run's optimizers (their per-parameter state moves with the rows).
    """

    def __init__(
        self,
        model: nn.Module,
        modules: Sequence[ExpertParallelExperts],
        sharded: ShardedModel,
        group: dist.ProcessGroup | None,
    ) -> None:
        names = {id(m): n for n, m in model.named_modules()}
        self.modules = list(modules)
        self.names = [names.get(id(m), type(m).__name__) for m in self.modules]
        self.sharded = sharded
        self.group = group
        self.target: list[ExpertPlacement] = [m.placement for m in self.modules]  # what `restore` returns to
        self.reports: list[PlacementReport] = []
        self._counts: list[list[Tensor]] = [[] for _ in self.modules]
        self._hooks: list = []

    # -- counting ---------------------------------------------------------------------------------------------------
    def start_counting(self) -> None:
        """Count the tokens routed to each logical expert in training forwards, from now on (idempotent)."""
        if self._hooks:
            return
        for index, module in enumerate(self.modules):
            self._hooks.append(module.register_forward_pre_hook(self._counter(index)))

    def stop_counting(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._counts = [[] for _ in self.modules]

    def _counter(self, index: int) -> Callable[[nn.Module, tuple], None]:
        counts = self._counts

        def count(module: nn.Module, args: tuple) -> None:
            if not (module.training and _in_training_forward()) or len(args) < 2:
                return
            num = module.num_experts  # type: ignore[attr-defined]
            with torch.no_grad():
                flat = args[1].reshape(-1).long()
                kept = (flat >= 0) & (flat < num)
                counts[index].append(torch.bincount(flat[kept], minlength=num))  # list.append: safe from two lanes

        return count

    def counted(self) -> Tensor:
        """``[modules, E]`` float64: the tokens each logical expert received since the last call, summed over the
        group (collective over it); the window starts again."""
        rows = []
        for index, module in enumerate(self.modules):
            parts = self._counts[index]
            row = torch.stack(parts).sum(0) if parts else torch.zeros(module.num_experts, dtype=torch.int64)
            rows.append(row.to(torch.float64).cpu())
            self._counts[index] = []
        total = torch.stack(rows) if rows else torch.zeros(0, 0, dtype=torch.float64)
        if self.group is not None and dist.get_world_size(self.group) > 1 and total.numel():
            device = _device_of(self.modules[0])
            on_device = total.to(device)
            dist.all_reduce(on_device, group=self.group)
            total = on_device.cpu()  # NOTE: D2H sync (once per re-placement, at a step boundary)
        return total

    # -- placing ----------------------------------------------------------------------------------------------------
    def rebalance(self, step: int, optimizers: Optimizers, min_gain: float = 0.0) -> PlacementReport:
        """Re-place every module from the counted window (collective over the group, then the moves): a module
        moves when its balanced placement lowers the most loaded rank's tokens by more than ``min_gain`` (a
        fraction of the current most loaded rank's)."""
        counts = self.counted().tolist()
        chosen, layers = [], []
        for index, module in enumerate(self.modules):
            current, row = module.placement, counts[index]
            balanced = balanced_placement(row, current)
            before, after = max(current.rank_loads(row)), max(balanced.rank_loads(row))
            new = balanced if after < before * (1.0 - min_gain) else current
            chosen.append(new)
            layers.append(LayerPlacementReport(self.names[index], current.imbalance(row), new.imbalance(row),
                                               len(current.moved_experts(new))))  # fmt: skip
        move = self.place(chosen, optimizers)
        report = PlacementReport(step=step, layers=tuple(layers), move=move)
        self.reports.append(report)
        return report

    def place(self, placements: Sequence[ExpertPlacement], optimizers: Optimizers) -> MoveReport:
        """Move every module to ``placements[i]`` and make it the target (collective with the other holders of the
        modules' rows)."""
        if len(placements) != len(self.modules):
            raise ValueError(
                f"`ExpertPlacer.place`: {len(placements)} placements for the {len(self.modules)} experts modules this "
                "rank holds; pass one per module, in model order."
            )
        self.target = list(placements)
        return self._move_to(self.target, optimizers)

    def to_logical(self, optimizers: Optimizers) -> None:
        """Move every module to the identity placement (before a state dict is read); the target is kept."""
        self._move_to([ExpertPlacement.identity(m.num_experts, m.placement.ep) for m in self.modules], optimizers)

    def restore(self, optimizers: Optimizers) -> None:
        """Move every module back to its target placement (after a checkpoint is written)."""
        self._move_to(self.target, optimizers)

    def reset(self, optimizers: Optimizers) -> None:
        """Back to the identity, which becomes the target (before a checkpoint is loaded: it is logical)."""
        self.to_logical(optimizers)
        self.target = [m.placement for m in self.modules]

    def _move_to(self, placements: Sequence[ExpertPlacement], optimizers: Optimizers) -> MoveReport:
        moving = [(m, p) for m, p in zip(self.modules, placements) if m.placement != p]
        if not moving:
            return MoveReport(rows_sent=0, bytes_sent=0, seconds=0.0)
        fsdp = [m for m, _ in moving if isinstance(m, FSDPModule)]
        for module in fsdp:
            module.reshard()  # the module holds the sharded parameters, the ones the optimizer updates
        moves = [LayerMove(self._tensors(m, optimizers), m.placement, p) for m, p in moving]
        report = move_rows(moves)
        for module, placement in moving:
            module.set_placement(placement)
        self.sharded.rows_moved(fsdp)
        return report

    @staticmethod
    def _tensors(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> list[Tensor]:
        """Every tensor whose rows are the module's slots: each parameter, its gradient, and the optimizer state of
        its shape, in an order every rank derives alike."""
        out: list[Tensor] = []
        for param in module.parameters(recurse=False):
            out.append(param)
            if param.grad is not None:
                out.append(param.grad)
            for optimizer in optimizers:
                state = optimizer.state.get(param, {})
                out += [state[k] for k in sorted(state) if _follows(state[k], param)]
        return out


def _follows(value: object, param: Tensor) -> bool:
    return isinstance(value, Tensor) and value.dim() > 0 and tuple(value.shape) == tuple(param.shape)


def _device_of(module: nn.Module) -> torch.device:
    param = next(module.parameters())
    return param.device
