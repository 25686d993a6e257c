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

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_moe_overlap._compat import torch as torch_compat
from lightning_moe_overlap.moe.ep import ExpertParallelExperts
from lightning_moe_overlap.moe.expert_moves import LayerMove, MoveReport, RowTransfer, move_rows, transfer_rows
from lightning_moe_overlap.moe.placement import ExpertPlacement, balanced_placement, balanced_within_nodes
from lightning_moe_overlap.moe.router import _in_training_forward
from lightning_moe_overlap.parallelize.sharding import ShardedModel

Optimizers = Sequence[torch.optim.Optimizer]


@dataclass(frozen=True)
class LayerPlacementReport:
    """One experts module (``name``: its module name) at a re-placement: the most loaded ep rank's tokens over the
    mean rank's before and after (on the counted window), the logical experts that changed rank (``moved``), and the
    placement it runs with from then on."""

    name: str
    imbalance_before: float
    imbalance_after: float
    moved: tuple[int, ...]
    placement: ExpertPlacement

    @property
    def moved_experts(self) -> int:
        return len(self.moved)


@dataclass(frozen=True)
class PlacementReport:
    """One re-placement: the global step it followed (``trainer.global_step`` after that optimizer step), each module's
    report, and this rank's move."""

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
            with torch.no_grad():  # no host read: dropped choices land in an extra bin (a bincount would sync on CUDA)
                flat = args[1].reshape(-1).long()
                key = torch.where((flat >= 0) & (flat < num), flat, num)
                row = torch.zeros(num + 1, dtype=torch.int64, device=flat.device)
                row.index_add_(0, key, torch.ones_like(key))
                counts[index].append(row[:num])  # list.append: safe from the two lanes of the overlap

        return count

    def counted(self) -> list[list[float]]:
        """The tokens each logical expert of each module received since the last call, summed over the group
        (collective over it); the window starts again."""
        if not self.modules:
            return []
        device = _device_of(self.modules[0])
        rows = []
        for index, module in enumerate(self.modules):
            parts, self._counts[index] = self._counts[index], []
            zero = torch.zeros(module.num_experts, dtype=torch.int64, device=device)
            rows.append((torch.stack(parts).sum(0) if parts else zero).to(torch.float64))
        total = torch.cat(rows)
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(total, group=self.group)
        flat = total.tolist()  # NOTE: D2H sync (once per re-placement, at a step boundary)
        bounds = [0, *itertools.accumulate(m.num_experts for m in self.modules)]
        return [flat[a:b] for a, b in itertools.pairwise(bounds)]

    # -- placing ----------------------------------------------------------------------------------------------------
    def rebalance(
        self, step: int, optimizers: Optimizers, min_gain: float = 0.0, replicas: int = 0,
        node_of_rank: Sequence[int] | None = None,
    ) -> PlacementReport:  # fmt: skip
        """Re-place every module from the counted window (collective over the group, then the moves): a module
        moves when its balanced placement (with ``replicas`` replica slots; with ``node_of_rank``, the node of each
        ep rank, within each node) lowers the most loaded rank's tokens by more than ``min_gain`` (a fraction of
        the current most loaded rank's)."""
        counts = self.counted()
        chosen, layers = [], []
        for index, module in enumerate(self.modules):
            current, row = module.placement, counts[index]
            balanced = (balanced_placement(row, current, replicas) if node_of_rank is None
                        else balanced_within_nodes(row, current, replicas, node_of_rank))  # fmt: skip
            before, after = max(current.rank_loads(row)), max(balanced.rank_loads(row))
            new = balanced if after < before * (1.0 - min_gain) else current
            chosen.append(new)
            moved = tuple(current.moved_experts(new))
            before_after = current.imbalance(row), new.imbalance(row)
            layers.append(LayerPlacementReport(self.names[index], *before_after, moved, new))
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
        self.refresh_replicas()
        return report

    # -- replicas ---------------------------------------------------------------------------------------------------
    def refresh_replicas(self) -> int:
        """Copy every replica's rows from its primary (after each optimizer step and each move), in one exchange;
        the bytes this rank sent. Collective among the modules' ep ranks; nothing without replicas."""
        transfers = []
        for module, name, param, rows in self._replicated(_local):
            for src_rank, src_row, dst_rank, dst_row, me in _replica_routes(module, getattr(module, name)):
                source, target = (param if src_rank == me else None), (rows if dst_rank == me else None)
                transfers.append(RowTransfer(src_rank, source, src_row, dst_rank, target, dst_row))
        return transfer_rows(transfers) if transfers else 0

    def sum_replica_gradients(self, divisor: int = 1) -> None:
        """Add each replica's weight gradient to its primary's, in replica-slot order, and drop the replicas'
        (after the step's backward, before the gradients are reduced over data parallelism). ``divisor``: what the
        parameters' gradients were divided by after the backward and the replicas' were not (torch's pipeline
        schedule at ``pp > 1``). Collective among the modules' ep ranks; nothing without replicas."""
        transfers, done = [], []
        for module, name, grad, rows in self._replicated(lambda p: None if p.grad is None else _local(p.grad)):
            if grad is None:
                continue
            if rows.grad is not None and divisor != 1:
                rows.grad.div_(divisor)
            for src_rank, src_row, dst_rank, dst_row, me in _replica_routes(module, getattr(module, name)):
                source = rows.grad if rows.grad is not None else torch.zeros_like(rows)
                transfers.append(RowTransfer(dst_rank, source if dst_rank == me else None, dst_row, src_rank,
                                             grad if src_rank == me else None, src_row))  # fmt: skip
            done.append(rows)
        if transfers:
            transfer_rows(transfers, accumulate=True)
        for rows in done:
            rows.grad = None

    @property
    def has_replicas(self) -> bool:
        return any(m.replica_slots is not None for m in self.modules)

    def _replicated(self, pick: Callable[[nn.Parameter], Tensor | None]) -> list[tuple]:
        """``(module, name, pick(parameter), replica rows)`` of every replicated module's parameters, in order."""
        return [
            (module, name, pick(param), module.replica_slots.rows[name])
            for module in self.modules
            if module.replica_slots is not None
            for name, param in module.named_parameters(recurse=False)
        ]

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


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _routes(placement: ExpertPlacement, owners: tuple[int, ...], me: int) -> tuple[tuple[int, int, int, int, int], ...]:
    slot_of, per_rank, replicas_per_rank = placement.slot_of(), placement.slots_per_rank, placement.replicas_per_rank
    routes = []
    for j, expert in enumerate(placement.replicas):
        slot = slot_of[expert]
        routes.append((owners[slot // per_rank], slot % per_rank, owners[j // replicas_per_rank],
                       j % replicas_per_rank, me))  # fmt: skip
    return tuple(routes)


def _replica_routes(module: ExpertParallelExperts, param: Tensor) -> tuple[tuple[int, int, int, int, int], ...]:
    """``(primary rank, primary row, replica rank, replica row, this rank)`` of each replica slot of ``module``:
    the primary's rows from ``param``'s layout over the ep ranks, replica slot ``j`` on the ``j // (R / ep)``-th of
    them."""
    slots = module.replica_slots
    assert slots is not None
    if id(param) not in slots.routes:  # one placement per `ReplicaSlots`: computed once
        me = dist.get_rank() if dist.is_initialized() else 0
        owners = torch_compat.row_owners(param) if isinstance(param, DTensor) else [(me, 0, param.shape[0])]
        slots.routes[id(param)] = _routes(module.placement, tuple(rank for rank, _, _ in owners), me)
    return slots.routes[id(param)]


def _follows(value: object, param: Tensor) -> bool:
    return isinstance(value, Tensor) and value.dim() > 0 and tuple(value.shape) == tuple(param.shape)


def _device_of(module: nn.Module) -> torch.device:
    param = next(module.parameters())
    return param.device
