"""What the strategy does to a user's model: make its experts expert-parallel, keep replicas equal, sync grads.

At ``pp > 1`` the model is the unsplit one, and the tensors of the chunks other pp ranks hold are on the meta
device (``pipeline/pipelined.py``): everything here acts on the tensors this rank holds, which are the same ones on
every rank of a ``dp_cp`` group (they share the pp coordinate).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_moe_overlap.config import OverlapConfig
from lightning_moe_overlap.parallel.grads import sync_expert_gradients
from lightning_moe_overlap.moe.adapters import find_moe_blocks
from lightning_moe_overlap.moe.bias import CorrectionBiasBalancer, correction_bias_balancers
from lightning_moe_overlap.moe.ep import ExpertParallelExperts, apply_expert_parallel
from lightning_moe_overlap.moe.router import TopKRouter
from lightning_moe_overlap.overlap.runtime import CommRuntime
from lightning_moe_overlap.parallel import ParallelGroups
from lightning_moe_overlap.parallel.dtensors import local


class MoEModelHandle:
    """A handle over a model's MoE layers (not a module itself): makes its experts expert-parallel, tells expert from
    dense parameters, and does the per-step work on them (replica broadcast, gradient sync, router updates)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._ep_modules: list[ExpertParallelExperts] = []
        self._bias_balancers: list[CorrectionBiasBalancer] = []

    def experts_per_block(self) -> Mapping[str, int]:
        """``{module name: num_experts}`` for every experts module found (for validation before wrapping)."""
        return find_moe_blocks(self.model)

    def apply(
        self,
        config: OverlapConfig,
        groups: ParallelGroups,
        runtime: CommRuntime,
        modules: Sequence[nn.Module] | None = None,
        ep_mesh: DeviceMesh | None = None,
    ) -> None:
        """Replace every experts module by its expert-parallel version holding only this rank's experts.

        ``modules``: the parts of the model to apply it to (at ``pp > 1`` the chunks this rank holds); the whole
        model by default. ``ep_mesh``: the 1-D mesh of ``groups.ep``; the expert parameters become ``DTensor``s
        ``Shard(0)`` over it.
        """
        backend_knobs = {  # each backend takes its own
            "deepep_num_sms": config.deepep_num_sms, "dedup": config.alltoall_dedup, "static": config.alltoall_static
        }
        self._ep_modules, self._bias_balancers = [], []
        for module in [self.model] if modules is None else modules:
            self._ep_modules += apply_expert_parallel(
                module, groups.ep, dispatcher=config.dispatcher, runtime=runtime,
                capacity_factor=config.capacity_factor, token_drop_policy=config.token_drop_policy,
                expert_backend=config.expert_backend, shared_expert_overlap=config.shared_expert_overlap,
                ep_mesh=ep_mesh, **backend_knobs,
            )  # fmt: skip
            self._bias_balancers += correction_bias_balancers(module)

    def routers(self) -> list[TopKRouter]:
        """The routers this rank holds (at ``pp > 1``, those of its own chunks)."""
        return [m for m in self.model.modules() if isinstance(m, TopKRouter) and not _is_meta(m)]

    def set_aux_loss_scale(self, scale: float) -> None:
        """Scale the routers' aux / z losses like the main loss (each micro-batch backpropagates ``loss / M``)."""
        for router in self.routers():
            router.aux_loss_scale = scale

    def update_expert_bias(self, group: dist.ProcessGroup) -> None:
        """Aux-loss-free balancing: move each router's expert bias from the token counts of the step (collective)."""
        for router in self.routers():
            if router.expert_bias is not None:
                router.update_expert_bias(group)
        for balancer in self._bias_balancers:  # HF routers' `e_score_correction_bias` (moe/bias.py)
            balancer.update(group)

    def expert_modules(self) -> list[ExpertParallelExperts]:
        """The expert-parallel modules this rank holds, in model order."""
        return list(self._ep_modules)

    def expert_parameters(self) -> list[nn.Parameter]:
        """The parameters of :meth:`expert_modules`, in model order (the same order on every rank of an edp group)."""
        return [p for m in self._ep_modules for p in m.parameters()]

    def broadcast_replicas(self, groups: ParallelGroups) -> None:
        """Make replicas equal, as DDP does at start: dense state from the first rank of each dp*cp group,
        expert state from the first rank of each edp group.

        ``DTensor`` s broadcast their local tensor, and only where it is a replica over that group: a dense tensor
        in one shard (``fully_shard`` over a size-1 dimension), an expert in its ep shards; one sharded over the
        group itself (``shard="optimizer"`` / ``"full"``) holds no replica to make equal and is left alone."""
        expert = [t for m in self._ep_modules for t in _state_tensors(m)]
        expert_ids = {id(t) for t in expert}
        dense = [t for t in _state_tensors(self.model) if id(t) not in expert_ids and not t.is_meta]
        _broadcast_from_first([local(t) for t in dense if _shards(t) == 1], groups.dp_cp)
        _broadcast_from_first([local(t) for t in expert if _shards(t) in (1, groups.dims.ep)], groups.edp)

    def sync_expert_gradients(self, groups: ParallelGroups) -> None:
        """Average the expert gradients over ``edp`` (the dense ones go through ``fully_shard``)."""
        expert = [p for p in self.expert_parameters() if p.requires_grad]
        sync_expert_gradients(expert, edp_group=groups.edp, dp_cp_size=groups.dims.dp * groups.dims.cp)


def _is_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in _state_tensors(module))


def _state_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def _shards(tensor: torch.Tensor) -> int:
    """Into how many distinct pieces a ``DTensor`` is split over its mesh (1 for a plain tensor)."""
    if not isinstance(tensor, DTensor):
        return 1
    mesh = tensor.device_mesh
    return math.prod(mesh.size(i) for i, placement in enumerate(tensor.placements) if placement.is_shard())


def _broadcast_from_first(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    if dist.get_world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t.data, src=src, group=group)
