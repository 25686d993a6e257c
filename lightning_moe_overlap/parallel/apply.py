"""How a model becomes the parallel model: ordered steps over one mesh.

``MoEOverlapStrategy.setup`` runs them in this order (torchtitan's: pipeline cut, TP, EP, activation checkpointing,
FSDP), each a function of the module and the mesh that can be called and tested alone:

1. :func:`apply_pipeline` (``pp > 1``): cut the model into ``pp * vpp`` chunks and allocate this rank's own
   (a model built on the meta device is initialised chunk by chunk).
2. tensor / sequence / context parallelism of the dense layers (``parallelize_module`` over ``mesh["tp"]``) plugs
   in here, on the held chunks, before the experts are replaced.
3. :func:`apply_ep`: every experts module becomes expert-parallel over ``mesh["ep"]`` (``DTensor`` experts), its
   routers' auxiliary losses scaled like the main loss.
4. activation checkpointing: the ``Recompute`` callback wraps the chunks at ``on_fit_start``, after these steps.
5. the precision plugin converts the module, and it moves to the device; replicas are made equal
   (``MoEModelHandle.broadcast_replicas``, ``DTensor``-aware).
6. :func:`apply_fsdp`: ``fully_shard`` the dense parameters (replicas at ``shard="none"``, shards otherwise) and,
   when sharded, the experts over ``mesh["edp"]``.
7. loading published weights into the sharded model (``torch.distributed.checkpoint``) plugs in here, after the
   parameters have their final placement and before the optimizers are built.

The groups every step uses come from the one mesh (:meth:`ParallelMesh.process_groups`).
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_moe_overlap.config import OverlapConfig, ShardMode
from lightning_moe_overlap.overlap.runtime import CommRuntime
from lightning_moe_overlap.parallel.mesh import ParallelMesh
from lightning_moe_overlap.parallel.sharding import ShardedModel, replicate_mesh
from lightning_moe_overlap.pipeline.pipelined import PipelinedModel
from lightning_moe_overlap.moe.handle import MoEModelHandle


def apply_pipeline(
    module: LightningModule, config: OverlapConfig, mesh: ParallelMesh, device: torch.device, *, rank: int
) -> PipelinedModel | None:
    """At ``pp > 1``: cut ``module`` into its chunks and allocate this rank's on ``device``; ``None`` at ``pp = 1``."""
    if mesh.dims.pp == 1:
        return None
    pipeline = PipelinedModel.cut(module, config, mesh.process_groups(rank))
    pipeline.place(device, seed=torch.initial_seed())
    return pipeline


def apply_ep(
    ep_model: MoEModelHandle,
    config: OverlapConfig,
    mesh: ParallelMesh,
    runtime: CommRuntime,
    pipeline: PipelinedModel | None,
    *,
    rank: int,
) -> None:
    """Make the experts of ``ep_model`` (of the chunks this rank holds at ``pp > 1``) expert-parallel over
    ``mesh["ep"]``, and scale the routers' auxiliary losses: by ``1 / num_microbatches`` at ``pp = 1`` (each
    micro-batch backpropagates ``loss / M``), not at all at ``pp > 1`` (torch's schedules divide every gradient)."""
    held = None if pipeline is None else pipeline.held_chunks
    ep_model.apply(config, mesh.process_groups(rank), runtime, modules=held, ep_mesh=mesh["ep"])
    ep_model.set_aux_loss_scale(1.0 if held is not None else 1.0 / config.num_microbatches)


def apply_fsdp(
    model: nn.Module,
    ep_model: MoEModelHandle,
    config: OverlapConfig,
    mesh: ParallelMesh,
    pipeline: PipelinedModel | None,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> ShardedModel:
    """``fully_shard`` the model (``parallel/sharding.py``): at ``shard="none"`` the dense parameters of ``model``
    (of each held chunk at ``pp > 1``) become replicas over ``dp x cp``, the experts left alone; otherwise the
    experts are sharded over ``edp`` and the dense parameters over ``dp x cp``."""
    if config.shard == "none":
        roots = [model] if pipeline is None else pipeline.held_chunks
        return ShardedModel.replicate(roots, ep_model.expert_parameters(), replicate_mesh(mesh))
    mode: ShardMode = config.shard  # type: ignore[assignment]
    return ShardedModel.shard(model, ep_model.expert_modules(), mesh, mode, mp_policy=mp_policy)
