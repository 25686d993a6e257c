"""How a model becomes the parallel model: ordered steps over one mesh.

:func:`parallelize_model` (called once per model by ``MoEOverlapStrategy.setup``) runs them in this order
(torchtitan's: pipeline cut, TP, EP, activation checkpointing, FSDP) and returns the record of what it built
(``parallelize/prepared_model.py``); each step is a function of the module and the mesh that can be called and tested
alone. ``configure_model`` runs under the meta device at every pp (``parallelize/meta_build.py``), so the model may
arrive without memory; each rank then allocates only what it holds (``parallelize/materialize.py``):

1. :func:`apply_pipeline` (``pp > 1``): cut the model into ``pp * vpp`` chunks; the other pp ranks' chunks go to the
   meta device, this rank's stay where they are (on its device, or on meta until the next steps).
2. :func:`apply_materialize`: the held dense tensors built on meta are allocated and given their seeded init (the
   values of the unsplit model, whatever the layout); the experts wait for step 4. With ``shard="optimizer" |
   "full"`` the modules with parameters stay on meta through steps 3-7 and get their values after step 7, each rank
   allocating only its shards (7b).
3. :func:`apply_tp` (``tp > 1``): tensor and sequence parallelism of the dense layers (``parallelize_module`` over
   ``mesh["tp"]`` with the model's plan, ``parallelize/tensor_plan.py``), each tp rank keeping its shard of the
   tensors it initialised; the routers learn their sequence group. The experts are left whole: ep folds over the tp ranks.
3b. :func:`apply_cp` (``cp > 1``): the LightningModule gets its ``context_parallel`` handle (it shards its
   micro-batches' sequences, ``parallel/context_module.py``) and the routers the ``cp x tp`` group as their
   sequence group.
4. :func:`apply_ep`: every experts module becomes expert-parallel over ``mesh["ep"]`` (``DTensor`` experts), its
   routers' auxiliary losses scaled like the main loss. Experts built on meta get only this rank's slice: one layer
   at a time the full experts are initialised, the slice kept and the rest freed (left uninitialised when a
   checkpoint will fill them, ``hf_weights``).
4b. :func:`apply_fp8_step` (``fp8`` set): the dense linears and the now expert-parallel experts in FP8
   (``fp8.apply_fp8``; docs/fp8.md), before the precision plugin and ``fully_shard`` see the modules; with
   ``dispatcher="alltoall"`` the experts' rows are dispatched in FP8. At ``pp > 1`` every chunk is converted, this
   rank's allocated ones and the others' on meta alike. After step 3 at ``tp > 1``: each planned
   linear's FP8 replacement gets its style again (``parallel/tp_styles.py::PlannedLinear``). With ``shard="full"``
   (``tensorwise``, ``tp = 1``) the dense weights are then all-gathered in float8.
5. activation checkpointing: the ``Recompute`` callback wraps the chunks at ``on_fit_start``, after these steps.
6. the precision plugin converts the module, and it moves to the device; replicas are made equal
   (``MoEModelHandle.broadcast_replicas``, ``DTensor``-aware).
7. :func:`apply_fsdp`: ``fully_shard`` the dense parameters (replicas at ``shard="none"``, shards otherwise) and,
   when sharded, the experts over ``mesh["edp"]``; at ``pp > 1`` each held chunk is a root of its own.
7b. ``materialize_deferred`` (sharded modes): the dense modules left on meta get their shards, one module at a time
   built whole transiently, initialised and cut: no rank holds the dense part of its model or stage whole.
8. :func:`apply_pretrained`: a LightningModule that declares ``hf_weights`` (a published Hugging Face checkpoint, or
   one per HF model; declared by the strategy for a ``from_pretrained`` in ``configure_model``, ``hf/pretrained.py``)
   gets them read into the sharded model (``torch.distributed.checkpoint``'s HF reader, ``hf/load.py``), after the
   parameters have their final placement and before the optimizers are built: ``parallelize/held_tensors.py`` gives
   what this rank holds and the whole model's shapes, by the unsplit model's names; each rank reads only its part, and the
   load fails before the first step unless every tensor under the prefix was written.
9. :func:`apply_compile` (``compile=True``): the forward of every dense region of the held model or chunks through
   ``torch.compile`` (``parallelize/compile_regions.py``), last, so that every step before sees plain modules.

The groups every step uses come from the one mesh (:meth:`ParallelMesh.process_groups`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_moe_overlap._compat import torch as torch_compat
from lightning_moe_overlap.config import OverlapConfig, ShardMode
from lightning_moe_overlap.fp8.apply import Float8Report, apply_fp8
from lightning_moe_overlap.fp8.dense import FLOAT8_ALL_GATHER_RECIPE
from lightning_moe_overlap.hf.load import HFLoadReport, as_hf_weights_list, load_hf_weights
from lightning_moe_overlap.moe.model_handle import MoEModelHandle
from lightning_moe_overlap.overlap.runtime import CommRuntime
from lightning_moe_overlap.parallel.context_attention import ContextParallelAttention
from lightning_moe_overlap.parallel.context_module import ATTR as CP_ATTR
from lightning_moe_overlap.parallel.context_module import ContextParallel
from lightning_moe_overlap.parallel.dims import ParallelDims
from lightning_moe_overlap.parallel.grad_reduce import BeforeReduce
from lightning_moe_overlap.parallel.groups import ParallelGroups
from lightning_moe_overlap.parallel.mesh import ParallelMesh
from lightning_moe_overlap.parallel.tp_styles import apply_tensor_parallel
from lightning_moe_overlap.parallelize.compile_regions import compile_dense_regions
from lightning_moe_overlap.parallelize.expert_placer import ExpertPlacer
from lightning_moe_overlap.parallelize.held_tensors import global_shapes, held_tensors
from lightning_moe_overlap.parallelize.materialize import (
    WEIGHTS_ATTR,
    DeferredDense,
    MetaInit,
    defer_dense,
    find_meta_experts,
    materialize_deferred,
    materialize_dense,
    materialize_experts,
    meta_init_of,
)
from lightning_moe_overlap.parallelize.prepared_model import PreparedModel
from lightning_moe_overlap.parallelize.sharding import ShardedModel, replicate_mesh
from lightning_moe_overlap.parallelize.tensor_plan import TensorParallelGrads, plan_of, set_sequence_group
from lightning_moe_overlap.pipeline.chunks import SEQUENCE_SHARDS_ATTR
from lightning_moe_overlap.pipeline.pipelined import PipelinedModel
from lightning_moe_overlap.validation import check_model, raise_problems


def parallelize_model(
    module: LightningModule,
    config: OverlapConfig,
    mesh: ParallelMesh,
    groups: ParallelGroups,
    runtime: CommRuntime,
    *,
    device: torch.device,
    convert_precision: Callable[[nn.Module], object],
) -> PreparedModel:
    """Every step above, in its order, on the LightningModule as ``configure_model`` left it; returns the record of
    what was built (``parallelize/prepared_model.py``). ``convert_precision`` is the precision plugin's
    ``convert_module`` (step 6). Collective: every rank calls it."""
    ep_model = MoEModelHandle(module)
    raise_problems(check_model(config, ep_model.experts_per_block(), mesh.dims.ep_span))
    pipeline = apply_pipeline(module, config, mesh, device, rank=groups.rank)
    init = meta_init_of(module, device, torch.initial_seed(), None if pipeline is None else pipeline.split)
    deferred = apply_materialize(module, init, pipeline, defer=config.shard != "none")
    apply_tp(module, mesh, pipeline)
    cp = apply_cp(module, mesh, pipeline)
    apply_ep(ep_model, config, mesh, runtime, pipeline, rank=groups.rank, init=init)
    tp_grads = tensor_parallel_grads(module, mesh, pipeline)
    fp8 = apply_fp8_step(module, config.fp8, device, config)
    convert_precision(module)
    place_model(module, pipeline, device, keep_meta=bool(deferred.modules))
    ep_model.broadcast_replicas(groups)
    early_tp = tp_grads is not None and config.overlap_grad_reduce and config.shard != "none"
    # the early sums run on the reduction lane while the backward issues its own tp collectives: their own group
    before_reduce = tp_grads.unit_reducer(module, mesh.side_group("tp", groups.rank)) if early_tp else None
    sharded = apply_fsdp(module, ep_model, config, mesh, pipeline, mp_policy=config.fsdp_mp_policy,
                         before_reduce=before_reduce)  # fmt: skip
    materialize_deferred(module, deferred, init, sharded.roots)
    loaded = apply_pretrained(module, pipeline)
    placer = ExpertPlacer(module, ep_model.expert_modules(), sharded, groups.dp_cp_tp)
    compiled = apply_compile(module, config, pipeline)
    return PreparedModel(config, mesh.dims, groups, mesh, runtime, ep_model, pipeline, sharded, tp_grads, cp, fp8,
                         loaded, placer, compiled)  # fmt: skip


def apply_compile(module: nn.Module, config: OverlapConfig, pipeline: PipelinedModel | None) -> tuple[str, ...]:
    """With ``compile=True``: compile the dense regions of what this rank holds; returns their names."""
    if not config.compile:
        return ()
    roots = [module] if pipeline is None else pipeline.held_chunks
    names = tuple(compile_dense_regions(roots))
    rank_zero_info(f"MoEOverlapStrategy(compile=True): {len(names)} dense regions compiled (torch.compile), the "
                   "experts eager.")  # fmt: skip
    return names


def place_model(
    model: nn.Module, pipeline: PipelinedModel | None, device: torch.device, *, keep_meta: bool = False
) -> None:
    """Move what this rank holds to ``device``: the whole model at ``pp = 1``, its chunks at ``pp > 1`` (the other pp
    ranks' chunks stay on meta). ``keep_meta``: the held tensors still on meta stay there (deferred until sharded,
    :func:`apply_materialize`)."""
    if pipeline is not None:
        pipeline.place(device, seed=torch.initial_seed(), materialize=not keep_meta)
    elif keep_meta:
        torch_compat.module_to(model, device)
    else:
        model.to(device)


def apply_pipeline(
    module: LightningModule, config: OverlapConfig, mesh: ParallelMesh, device: torch.device, *, rank: int
) -> PipelinedModel | None:
    """At ``pp > 1``: cut ``module`` into its chunks and allocate this rank's on ``device``; ``None`` at ``pp = 1``."""
    if mesh.dims.pp == 1:
        return None
    pipeline = PipelinedModel.cut(module, config, mesh.process_groups(rank))
    pipeline.place(device, seed=torch.initial_seed(), materialize=False)  # tensors on meta: apply_materialize, apply_ep
    return pipeline


def apply_materialize(
    model: nn.Module, init: MetaInit, pipeline: PipelinedModel | None, *, defer: bool = False
) -> DeferredDense:
    """Allocate and initialise the dense tensors this rank holds that were built on meta (all of ``model`` at
    ``pp = 1``, the held chunks at ``pp > 1``), the experts excepted (:func:`apply_ep`). With ``defer`` (the sharded
    modes) the modules with parameters stay on meta until :func:`apply_fsdp` has sharded them
    (``materialize_deferred``: no rank holds the dense part whole); returns them."""
    roots = None if pipeline is None else pipeline.held_chunks
    deferred = defer_dense(model, roots) if defer else DeferredDense({})
    materialize_dense(model, init, roots, exclude=deferred)
    return deferred


def apply_tp(module: LightningModule, mesh: ParallelMesh, pipeline: PipelinedModel | None = None) -> None:
    """At ``tp > 1``: ``parallelize_module`` the LightningModule with its plan (``plan_of``: its
    ``tensor_parallel_plan`` hook or its Hugging Face model's plan), and give every ``TopKRouter`` the tp group as its
    sequence group (its balancing loss counts the whole sequence's tokens). At ``pp > 1`` the plan applies to the
    whole model by its names, so to every chunk (the chunks share its modules; the other ranks' stay on meta), and
    the chunks that rebuild per-position tensors learn that their inputs hold ``S / tp`` positions
    (``SEQUENCE_SHARDS_ATTR``). Nothing at ``tp = 1``."""
    if mesh.dims.tp == 1:
        return
    tp_mesh = mesh["tp"]
    apply_tensor_parallel(module, tp_mesh, plan_of(module, tp_mesh))
    set_sequence_group(module, mesh.group("tp"))
    for chunk in [] if pipeline is None else pipeline.split.chunks:
        if hasattr(chunk, SEQUENCE_SHARDS_ATTR):
            setattr(chunk, SEQUENCE_SHARDS_ATTR, mesh.dims.tp)


def apply_cp(
    module: LightningModule, mesh: ParallelMesh, pipeline: PipelinedModel | None = None
) -> ContextParallel | None:
    """At ``cp > 1``: set ``module.context_parallel`` to this rank's :class:`ContextParallel` (the module shards its
    micro-batches with it) and give every ``TopKRouter`` the ``cp x tp`` group as its sequence group (its balancing
    loss counts the whole sequence's tokens: at ``tp > 1`` sequence parallelism splits each cp rank's part again over
    tp). Returns the handle; ``None`` at ``cp = 1`` (the attribute, if declared, stays).

    Raises:
        NotImplementedError: the LightningModule does not declare ``context_parallel`` (rule ``cp-model``): the
            strategy cannot know which of its tensors are sequences, nor how it shifts its targets. At ``pp > 1``,
            pipeline chunks whose batches are not sharded by the splitter (``PipelineChunks.cp_sharded``; rule
            ``cp-pipeline-chunks``)."""
    if mesh.dims.cp == 1:
        return None
    if not hasattr(module, CP_ATTR):
        raise NotImplementedError(
            f"`MoEOverlapStrategy(cp={mesh.dims.cp})` (rule `cp-model`, docs/validation.md): "
            f"`{type(module).__name__}` declares no `{CP_ATTR}` attribute, so nothing would shard its sequences over "
            "the cp ranks. Rule: a model runs at cp > 1 when it shards its micro-batches itself (`MoEGPT` and "
            "`HFMoECausalLM` do). Fix: use cp=1, or declare "
            f"`{CP_ATTR} = None` on the LightningModule and shard with it in the loss (docs/context_parallel.md; "
            "for a Hugging Face model, `lightning_moe_overlap.hf.context.context_parallel_loss`)."
        )
    _check_chunks_shard(pipeline, mesh.dims)
    cp_mesh = mesh["cp"]
    handle = ContextParallel(cp_mesh.size(), cp_mesh.get_local_rank(), ContextParallelAttention(cp_mesh),
                             tp=mesh.dims.tp, sequence_group=mesh.group("cp_tp"))  # fmt: skip
    setattr(module, CP_ATTR, handle)
    set_sequence_group(module, mesh.group("cp_tp"))
    return handle


def _check_chunks_shard(pipeline: PipelinedModel | None, dims: ParallelDims) -> None:
    """At ``pp > 1``: refuse chunks whose ``prepare_batch`` does not shard the sequences over cp."""
    if pipeline is None or pipeline.split.cp_sharded:
        return
    owner = type(pipeline.split.model).__name__
    raise NotImplementedError(
        f"`MoEOverlapStrategy(cp={dims.cp}, pp={dims.pp})` (rule `cp-pipeline-chunks`, docs/validation.md): the "
        f"pipeline chunks of `{owner}` do not declare `cp_sharded=True`. Rule: at pp > 1 the batch goes to the "
        "splitter's `prepare_batch` / `chunk_kwargs`, which must give each cp rank its shard of every sequence (the "
        "ring would take whole sequences for shards). Fix: shard there with the module's `context_parallel` handle "
        "and return `PipelineChunks(..., cp_sharded=True)` from `configure_pipeline` (docs/pipeline.md), use the "
        "built-in splitter (Hugging Face decoders) or `MoEGPT`, or cp=1."
    )


def aux_loss_scale(num_microbatches: int, dims: ParallelDims, *, pipelined: bool) -> float:
    """The routers' auxiliary-loss weight: ``1 / num_microbatches`` at ``pp = 1`` (each micro-batch backpropagates
    ``loss / M``), ``1`` at ``pp > 1`` (torch's schedules divide every gradient); times ``cp``, because each cp rank's
    balancing loss is its share of the whole sequence's (the shares add up) while the gradients are averaged over
    ``dp x cp``."""
    return (1.0 if pipelined else 1.0 / num_microbatches) * dims.cp


def tensor_parallel_grads(
    module: nn.Module, mesh: ParallelMesh, pipeline: PipelinedModel | None = None
) -> TensorParallelGrads | None:
    """At ``tp > 1``, after :func:`apply_ep`: the dense parameters the plan left whole (of the held chunks at
    ``pp > 1``), whose gradients are summed over tp each step (``TensorParallelGrads``); None at ``tp = 1``."""
    if mesh.dims.tp == 1:
        return None
    return TensorParallelGrads.of(module, mesh.group("tp"), None if pipeline is None else pipeline.held_chunks)


def apply_ep(
    ep_model: MoEModelHandle,
    config: OverlapConfig,
    mesh: ParallelMesh,
    runtime: CommRuntime,
    pipeline: PipelinedModel | None,
    *,
    rank: int,
    init: MetaInit | None = None,
) -> None:
    """Make the experts of ``ep_model`` (of the chunks this rank holds at ``pp > 1``) expert-parallel over
    ``mesh["ep"]``, and scale the routers' auxiliary losses: by ``1 / num_microbatches`` at ``pp = 1`` (each
    micro-batch backpropagates ``loss / M``), not at all at ``pp > 1`` (torch's schedules divide every gradient),
    times ``cp`` (:func:`aux_loss_scale`).

    Experts built on meta get this rank's slice per ``init`` (``materialize_experts``); without ``init`` they stay
    on meta."""
    held = None if pipeline is None else pipeline.held_chunks
    pending = find_meta_experts(ep_model.model, held) if init is not None else []
    ep_model.apply(config, mesh.process_groups(rank), runtime, modules=held, ep_mesh=mesh["ep"])
    if init is not None:
        materialize_experts(pending, init)
    ep_model.set_aux_loss_scale(aux_loss_scale(config.num_microbatches, mesh.dims, pipelined=held is not None))
    if config.alltoall_static:
        cf = config.capacity_factor
        slots = "every token (dropless)" if cf is None else f"capacity_factor={cf}"
        rank_zero_info(f"MoEOverlapStrategy(alltoall_static=True): {len(ep_model.expert_modules())} MoE layers "
                       f"dispatch in static slots holding {slots}; no host read per layer.")  # fmt: skip


def apply_fp8_step(
    model: nn.Module, fp8: str | None, device: torch.device, config: OverlapConfig | None = None
) -> Float8Report | None:
    """With ``fp8`` (a recipe name): run ``model``'s dense linears and routed experts in FP8 (``apply_fp8``), after
    :func:`apply_ep` (the expert-parallel experts take the FP8 kernel, and their dispatcher then sends the rows in
    FP8) and before :func:`apply_fsdp`; the layers left in high precision are logged once. ``None``: nothing.

    With ``config.shard="full"``, ``fp8="tensorwise"`` and ``tp = 1`` the dense weights are all-gathered in float8
    (``Float8Report.float8_all_gather``; the strategy then calls ``precompute_float8_scales`` after each optimizer
    step). At ``tp > 1`` they are not: a planned linear's weight is already a tp ``DTensor``, which torchao's float8
    weight wrapper does not take through the plan (docs/fp8.md)."""
    if fp8 is None:
        return None
    float8_all_gather = (
        config is not None and config.shard == "full" and config.tp == 1 and fp8 == FLOAT8_ALL_GATHER_RECIPE
    )
    report = apply_fp8(model, fp8, device=device, float8_all_gather=float8_all_gather)
    rank_zero_info(f"`MoEOverlapStrategy(fp8={fp8!r})`: {report}")
    if config is not None and config.shard == "full" and not float8_all_gather:
        why = f"tp={config.tp}" if config.tp > 1 else f"fp8={fp8!r}"
        rank_zero_info(
            f"`MoEOverlapStrategy(fp8={fp8!r}, shard='full')`: weights all-gathered in the training dtype, not in "
            f"float8 ({why}; the float8 all-gather runs with fp8='{FLOAT8_ALL_GATHER_RECIPE}' at tp=1, docs/fp8.md)."
        )
    return report


def apply_fsdp(
    model: nn.Module,
    ep_model: MoEModelHandle,
    config: OverlapConfig,
    mesh: ParallelMesh,
    pipeline: PipelinedModel | None,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    before_reduce: BeforeReduce | None = None,
) -> ShardedModel:
    """``fully_shard`` the model (``parallelize/sharding.py``): at ``shard="none"`` the dense parameters of ``model``
    (of each held chunk at ``pp > 1``) become replicas over ``dp x cp``, the experts left alone; otherwise the
    experts are sharded over ``edp`` and the dense parameters over ``dp x cp``, of ``model`` at ``pp = 1`` and of each
    held chunk at ``pp > 1`` (each layer a unit of its own with ``overlap_grad_reduce``; ``before_reduce``: what runs
    before each unit's early reduction, the tp replicas' sum at ``tp > 1``; with ``delay_wgrad`` the experts units
    are reduced at the end of the step)."""
    roots = [model] if pipeline is None else pipeline.held_chunks
    if config.shard == "none":
        return ShardedModel.replicate(roots, ep_model.expert_parameters(), replicate_mesh(mesh))
    mode: ShardMode = config.shard  # type: ignore[assignment]
    return ShardedModel.shard(roots, ep_model.expert_modules(), mesh, mode, mp_policy=mp_policy,
                              overlap_grad_reduce=config.overlap_grad_reduce, before_reduce=before_reduce,
                              held_back=ep_model.expert_modules() if config.delay_wgrad else ())  # fmt: skip


def apply_pretrained(module: LightningModule, pipeline: PipelinedModel | None) -> HFLoadReport | None:
    """Read the checkpoints ``module.hf_weights`` declares (an ``HFWeights`` or a folder path, or a list of them, one
    per HF model) into the tensors this rank holds, each under its weights' prefix; ``None`` when it declares none.
    Several checkpoints give one combined report (``HFLoadReport.combined``). Collective: every rank calls it."""
    declared = as_hf_weights_list(getattr(module, WEIGHTS_ATTR, None), f"`{type(module).__name__}`")
    if not declared:
        return None
    held_all, shapes_all = held_tensors(module, pipeline), global_shapes(module)
    reports = []
    for weights in declared:
        prefix = weights.prefix
        held = {n: t for n, t in held_all.items() if n.startswith(prefix)}
        shapes = {n: s for n, s in shapes_all.items() if n.startswith(prefix)}
        with torch.no_grad():
            reports.append(load_hf_weights(
                held, shapes, weights.path, family=weights.family, prefix=prefix, ignore=weights.ignore
            ))  # fmt: skip
    return reports[0] if len(reports) == 1 else HFLoadReport.combined(reports)
