"""``MoEOverlapStrategy``: a thin Lightning strategy that delegates to the parallel, moe, overlap and loop layers."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerStatus
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch import Tensor
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.nn import Module
from typing_extensions import override

from lightning_moe_overlap._compat import lightning as pl_compat
from lightning_moe_overlap._noise import quiet_third_party_noise
from lightning_moe_overlap.accumulation import Accumulation
from lightning_moe_overlap.checkpoint import checkpointer
from lightning_moe_overlap.checkpoint.background import BackgroundSaves
from lightning_moe_overlap.config import (
    CheckpointFormat,
    Dispatcher,
    DropPolicy,
    ExpertBackend,
    FlexBackend,
    OverlapConfig,
    PipelineSchedule,
    ShardMode,
    StartMethod,
)
from lightning_moe_overlap.float8.recipes import FP8Recipe
from lightning_moe_overlap.fp8.apply import Float8Report
from lightning_moe_overlap.fp8.dense import precompute_float8_scales
from lightning_moe_overlap.hf.export import DEFAULT_SHARD
from lightning_moe_overlap.hf.load import HFLoadReport
from lightning_moe_overlap.hf.sharded_export import ExportReport, export_hf_sharded, hf_model_path
from lightning_moe_overlap.loop import LoopPath, MicroBatchLoop, StepHooks, StepPath
from lightning_moe_overlap.loss.tokens import TokenScope
from lightning_moe_overlap.loss.vocab_parallel import plain_step_output
from lightning_moe_overlap.optim.host_offload import describe_offload, offload_optimizers
from lightning_moe_overlap.overlap.engine import OverlapEngine
from lightning_moe_overlap.overlap.failures import default_nccl_error_handling, safety_nets
from lightning_moe_overlap.overlap.runtime import CommRuntime
from lightning_moe_overlap.parallel import ParallelDims, ParallelGroups
from lightning_moe_overlap.parallel.grads import clip_grad_norm, global_grad_norm
from lightning_moe_overlap.parallel.mesh import ParallelMesh, build_mesh
from lightning_moe_overlap.parallelize.expert_placer import ExpertPlacer, PlacementReport
from lightning_moe_overlap.parallelize.held_tensors import global_shapes, held_tensors
from lightning_moe_overlap.parallelize.meta_build import meta_build
from lightning_moe_overlap.parallelize.prepared_model import PreparedModel, adopt, record
from lightning_moe_overlap.parallelize.steps import aux_loss_scale, parallelize_model, place_model
from lightning_moe_overlap.pipeline.path import PipelinePath
from lightning_moe_overlap.precision import ExpertParallelPrecision, with_global_norm_clip
from lightning_moe_overlap.processes.launcher import ExpertParallelScriptLauncher, ExpertParallelSpawnLauncher
from lightning_moe_overlap.processes.shutdown import destroy_process_groups_at_exit
from lightning_moe_overlap.processes.signals import SignalAgreement
from lightning_moe_overlap.step_logs import MicroBatchLogs
from lightning_moe_overlap.validation import (
    build_dims,
    check_config,
    check_flex,
    check_machine,
    check_train_loaders,
    check_trainer,
    check_world,
    raise_problems,
)

log = logging.getLogger(__name__)


class MoEOverlapStrategy(ParallelStrategy):
    """Expert-parallel Mixture-of-Experts training with the all-to-all hidden behind compute.

    The strategy builds the process groups (dp, ep, edp, tp, cp, pp), hands them to the LightningModule before
    ``configure_model`` as ``self.parallel_groups``, makes every MoE experts module of the model expert-parallel,
    splits each batch into micro-batches and runs them as an overlapped schedule inside one optimizer step.

    Args:
        ep: Expert-parallel size: experts are sharded over ``ep`` ranks and tokens exchanged by all-to-all.
            Must divide ``dp * cp * tp`` (the ranks of a pipeline stage) and every MoE block's number of experts.
        tp: Tensor-parallel size: the attention and dense layers are sharded over ``tp`` ranks by a plan
            (``parallelize_module``; the model's ``tensor_parallel_plan`` hook, or the plan a Hugging Face model
            carries) with sequence parallelism between them; the experts stay whole and ep folds over the tp ranks
            (docs/tensor_parallel.md). Must divide the attention heads.
        pp: Pipeline-parallel size: the model is cut into ``pp * vpp`` chunks (docs/pipeline.md), each rank builds
            and trains only its own, and each step runs as torch's pipeline schedule ``pipeline_schedule``.
        vpp: Virtual pipeline stages (chunks) per pp rank; None is 1, or the layout's chunks / ``pp``. Ignored
            (warning) at ``pp=1``.
        cp: Context-parallel size: each sequence is split over ``cp`` ranks (head-tail chunks) and attention runs as
            torch's ring over them (docs/context_parallel.md). The LightningModule shards its micro-batches with the
            ``context_parallel`` handle the strategy sets on it (``MoEGPT`` does); ``2 * cp`` must divide the
            sequence length. Not with ``pp > 1`` nor ``tp > 1`` in this version.
        pipeline_schedule: ``"1f1b"``, ``"interleaved_1f1b"``, ``"dualpipev"`` (vpp=2, a V) or ``"zero_bubble"``
            (no overlap); None picks ``1f1b`` at vpp=1 and ``interleaved_1f1b`` with virtual stages.
        pipeline_layout: Which layers each chunk holds, as a Megatron layout string (``"Et*3|(tt|)*29,m|L"``,
            grammar in docs/pipeline.md); None splits the layers evenly over the ``pp * vpp`` chunks.
        dispatcher: Token dispatcher: ``"alltoall"`` (uneven all-to-all, any backend), ``"allgather"`` (gather
            over ep, reduce-scatter back; small ep), ``"flex"`` (DeepEP kernels; CUDA only).
        flex_backend: Backend of the flex dispatcher (``"deepep"``); only valid with ``dispatcher="flex"``.
        overlap: Run the forward of micro-batch ``i+1`` and the backward of micro-batch ``i`` as two contexts that
            hand over at every all-to-all, so one's communication hides behind the other's compute (at ``pp > 1``:
            each forward / backward pair of the pipeline schedule). None (the default) turns it on whenever
            ``num_microbatches > 1``, at ``pp > 1`` only for ``dualpipev``: ``interleaved_1f1b`` overlaps when
            asked, but its pairs make the pp ranks take turns; ``1f1b`` overlaps when asked, its steady state all
            pairs at the cost of more micro-batches' activations in flight (docs/pipeline.md, "1F1B overlapped").
        delay_wgrad: Queue expert weight-gradient GEMMs during backward and run them while the next all-to-all
            is in flight.
        num_microbatches: Micro-batches per optimizer step; each batch from the dataloader is split evenly along
            its first dimension. ``Trainer(accumulate_grad_batches=A)`` adds ``A`` such batches per optimizer step
            (docs/overlap.md, "Gradient accumulation"). A loss divided by ``step_tokens`` (the built-in Hugging Face
            modules') is the per-token mean over the step's micro-batches and accumulated batches; any other, the
            mean over the micro-batches (docs/overlap.md, "Which mean a step's loss is").
        capacity_factor: Expert capacity as a multiple of the even share of tokens; None is dropless.
        token_drop_policy: Which assignments an over-capacity expert drops: ``"probs"`` (lowest probability) or
            ``"position"`` (latest tokens).
        shared_expert_overlap: Run the shared experts (``MoELayer``'s, HF blocks' ``shared_expert(s)``) while the
            dispatch all-to-all is in flight; needs ``overlap=False``.
        deepep_num_sms: Streaming multiprocessors the DeepEP kernels may use (even).
        alltoall_dedup: With ``dispatcher="alltoall"``, send a token once per destination rank rather than once
            per (token, expert) (docs/dispatchers.md, "Deduplicated dispatch"): fewer bytes (-17% at 4 experts
            top-2 over 2 ranks, more at larger top-k) for some extra permutation work. Off by default: on CPU it
            measured slower; turn it on where the all-to-all is bandwidth-bound (across nodes).
        alltoall_static: With ``dispatcher="alltoall"``, send fixed slots per (rank, expert) whose counts stay on
            the device, so no layer reads sizes back to the host (docs/dispatchers.md, "Static dispatch"). The slots
            hold ``capacity_factor``'s capacity (every token when dropless: ``num_experts / top_k`` times the rows on
            the wire); every ep rank must hold as many tokens per micro-batch.
        process_group_backend: ``"gloo"`` or ``"nccl"``; None picks the default for the device. On NCCL the
            strategy sets ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` unless it is set (docs/overlap.md, "Errors on NCCL").
        timeout: Seconds (or a ``timedelta``) a collective may wait before the run fails; None is Lightning's
            default of 30 minutes.
        start_method: How processes are launched: ``"popen"`` re-runs the script (scripts and the CLI),
            ``"spawn"``/``"fork"``/``"forkserver"`` use multiprocessing.
        checkpoint_format: How ``Trainer.save_checkpoint`` writes: ``"sharded"`` (default; a directory where each
            rank writes its own experts and a share of the rest, loadable at any ep/dp layout) or
            ``"consolidated"`` (one file with the full experts, as an unsharded run writes it; for inference and
            export). Both are committed atomically; loading reads either (docs/checkpoints.md).
        async_save: Write sharded checkpoints in the background while training goes on (DCP's ``async_save``: the
            save returns once this rank's tensors are copied to host memory; at most one save in flight; committed
            atomically when every rank's files are written). Lightning's ``AsyncCheckpointIO`` plugin turns it on
            too (docs/checkpoints.md, "Saving in the background").
        expert_backend: Kernels of the experts' GEMMs: ``"torch"`` (pure PyTorch grouped GEMMs, runs everywhere)
            or ``"te"`` (NVIDIA Transformer Engine's ``GroupedLinear``, CUDA only, with ``delay_wgrad`` through its
            ``backward_dw``; the ``te`` extra). Parameters and checkpoints are the same.
        shard: What is sharded with FSDP2 (``fully_shard``; docs/sharding.md): ``"none"`` (replicated parameters,
            gradients all-reduced), ``"optimizer"`` (ZeRO-1-like: optimizer state and gradients sharded, the full
            parameters gathered again after each optimizer step) or ``"full"`` (ZeRO-3-like: parameters sharded too,
            gathered once per step before the first micro-batch). Dense parameters are sharded over dp x cp, experts
            over edp. Not with ``pp > 1`` or ``expert_backend="te"``.
        sequence_parallel: With ``tp > 1``, run the norms, residuals and MoE blocks on each tp rank's share of the
            sequence (Megatron's ``--sequence-parallel``). Required with MoE blocks and ``tp > 1``: each tp rank
            routes its own tokens.
        fsdp_mp_policy: FSDP2's ``MixedPrecisionPolicy`` for the sharded modes (e.g. ``param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32``: bf16 compute copies of fp32 sharded parameters); None keeps the parameters'
            dtype. Gradients of the micro-batches of a step accumulate in ``param_dtype``.
        optimizer_cpu_offload: Keep the optimizer state of the largest parameters (``optimizer_offload_fraction``
            of the elements this rank holds) in host memory and run their update there, on host copies (float32
            masters of lower-precision parameters), copied back after each step (``optim/host_offload.py``,
            docs/memory.md). The optimizer ``configure_optimizers`` returns is wrapped; its groups, an LR scheduler
            on it, clipping by the global norm, every ``shard`` mode and the checkpoints work as without.
        optimizer_offload_fraction: The share in (0, 1] of the parameters' elements offloaded, largest parameters
            first; only with ``optimizer_cpu_offload``.
        fp8: Run the GEMMs in FP8 with this recipe (docs/fp8.md): ``"tensorwise"`` or ``"rowwise"`` current scaling
            (torchao's recipes, the ``fp8`` extra), or ``"mxfp8"`` (one power-of-two scale per block of 32 values,
            emulated where no MX tensor cores are); None (the default) keeps them in the training precision. The
            dense linears (output heads and routers left out) go through torchao, the experts through this
            package's FP8 kernel, and with ``dispatcher="alltoall"`` (deduplicated or not) the tokens are dispatched
            in FP8 (e4m3 with one scale per row, not with ``mxfp8``; the combine and the gradients stay in high
            precision). Weights, optimizer state and checkpoints are unchanged. Layers with a dim that is not a
            multiple of 16 (32 for ``mxfp8``) stay in high precision (a warning names them). Runs at ``tp > 1``
            (not ``mxfp8``) and ``pp > 1``; not with ``expert_backend="te"``.
        overlap_grad_reduce: In the sharded modes, make each layer an FSDP unit of its own and reduce-scatter each
            unit (the experts' over edp too) as soon as its gradients are final in the step's last backward, so the
            reduction runs under the rest of that backward instead of after it (Megatron's ``--overlap-grad-reduce``;
            docs/sharding.md). The same reductions of the same gradients, issued earlier. Without a sharded mode: a
            warning, no effect. At ``tp > 1`` each unit's tensor-parallel replicas are summed over tp just before its
            reduction (on a communicator of their own).
        token_mean_over_dp: For a loss divided by ``step_tokens`` (the built-in Hugging Face modules' default,
            ``loss/tokens.py``; docs/overlap.md, "Which mean a step's loss is"): the per-token mean over the tokens
            of every dp rank's batches (one all-reduce of the count per step; Hugging Face's
            ``average_tokens_across_devices``), not of each rank's own. Ranks with more labelled tokens then weigh
            more, as in one process training the global batch. False: each rank's own mean, averaged over dp.
        compile: Run the dense parts of every MoE block (attention, norms, dense MLPs, Hugging Face routers and
            shared experts) through ``torch.compile``, the experts and their dispatch eager (docs/compile.md). Both
            overlap contexts, the recompute and offload callbacks and ``pp > 1`` compose with it.
        overlap_param_gather: Megatron's ``--overlap-param-gather``. Accepted for the flag table, with a warning: the
            parameters are gathered once per step, before the first micro-batch, so there is no later all-gather to
            prefetch under compute (docs/sharding.md).
    """

    strategy_name = "moe_overlap"

    def __init__(
        self,
        ep: int = 1,
        tp: int = 1,
        pp: int = 1,
        vpp: int | None = None,
        cp: int = 1,
        pipeline_schedule: PipelineSchedule | None = None,
        pipeline_layout: str | None = None,
        dispatcher: Dispatcher = "alltoall",
        flex_backend: FlexBackend | None = None,
        overlap: bool | None = None,
        delay_wgrad: bool = False,
        num_microbatches: int = 1,
        capacity_factor: float | None = None,
        token_drop_policy: DropPolicy = "probs",
        shared_expert_overlap: bool = False,
        deepep_num_sms: int = 20,
        alltoall_dedup: bool = False,
        alltoall_static: bool = False,
        process_group_backend: str | None = None,
        timeout: float | timedelta | None = None,
        start_method: StartMethod = "popen",
        checkpoint_format: CheckpointFormat = "sharded",
        async_save: bool = False,
        expert_backend: ExpertBackend = "torch",
        shard: ShardMode = "none",
        sequence_parallel: bool = True,
        fsdp_mp_policy: MixedPrecisionPolicy | None = None,
        optimizer_cpu_offload: bool = False,
        optimizer_offload_fraction: float = 1.0,
        fp8: FP8Recipe | None = None,
        overlap_grad_reduce: bool = False,
        overlap_param_gather: bool = False,
        token_mean_over_dp: bool = False,
        compile: bool = False,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._config = OverlapConfig(
            ep=ep,
            tp=tp,
            pp=pp,
            vpp=vpp,
            cp=cp,
            dispatcher=dispatcher,
            flex_backend=flex_backend,
            overlap=overlap,
            delay_wgrad=delay_wgrad,
            num_microbatches=num_microbatches,
            capacity_factor=capacity_factor,
            token_drop_policy=token_drop_policy,
            shared_expert_overlap=shared_expert_overlap,
            deepep_num_sms=deepep_num_sms,
            alltoall_dedup=alltoall_dedup,
            alltoall_static=alltoall_static,
            process_group_backend=process_group_backend,
            start_method=start_method,
            expert_backend=expert_backend,
            pipeline_schedule=pipeline_schedule,
            pipeline_layout=pipeline_layout,
            shard=shard,
            sequence_parallel=sequence_parallel,
            overlap_grad_reduce=overlap_grad_reduce,
            overlap_param_gather=overlap_param_gather,
            compile=compile,
            token_mean_over_dp=token_mean_over_dp,
            fp8=fp8,
            fsdp_mp_policy=fsdp_mp_policy,
            checkpoint_format=checkpoint_format,
            async_save=async_save,
            optimizer_cpu_offload=optimizer_cpu_offload,
            optimizer_offload_fraction=optimizer_offload_fraction,
            timeout=timeout,
        )
        checkpointer.check_format(checkpoint_format)
        _as_timedelta(timeout)
        raise_problems(check_config(self.config))  # every rule broken, in one error
        self._num_nodes = 1
        self._dims: ParallelDims | None = None
        self._groups: ParallelGroups | None = None  # this run's, until a prepared model brings its own
        self._mesh: ParallelMesh | None = None
        self._runtime = CommRuntime(delay_wgrad=delay_wgrad)
        self._prepared: PreparedModel | None = None  # what `setup` built or adopted (parallelize/prepared_model.py)
        self._failed = False  # set by `on_exception`: the teardown then does no more work than it must
        self._signals = SignalAgreement()  # SIGTERM acted on at a batch boundary, by every rank together
        self._saves: BackgroundSaves | None = None  # the background checkpoint saves of a run (`async_save`)
        self._path: StepPath | None = None  # how the step methods run (loop.py, pipeline/path.py)
        self._loop_trainer: Trainer | None = None  # whose automatic optimization skips backward for the loop
        self.token_scope = TokenScope()  # the step's token count, for `step_tokens` (loss/tokens.py)
        self._accumulation: Accumulation | None = None  # while fitting: the accumulation windows of the batches

    @property
    def config(self) -> OverlapConfig:
        """Every setting the strategy was built with, as one frozen value (``config/settings.py``)."""
        return self._config

    # -- sizes and groups ------------------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def dims(self) -> ParallelDims:
        """The parallel sizes, known once the world size is (after the Trainer picked devices)."""
        if self._dims is None:
            self._dims = build_dims(self.config, self.num_nodes * self.num_processes)
        return self._dims

    @property
    def parallel_groups(self) -> ParallelGroups:
        """This rank's process group of each kind (dp, ep, edp, tp, cp, pp and their folds), read off the mesh; the
        prepared model's once set up. From ``configure_model`` on."""
        if self._prepared is not None:  # the groups its layers were built with
            return self._prepared.groups
        if self._groups is None:
            raise RuntimeError(
                "`MoEOverlapStrategy.parallel_groups` is only available after the processes have initialised "
                "(from `configure_model` on); it was accessed before."
            )
        return self._groups

    @property
    def parallel_mesh(self) -> ParallelMesh:
        """The ``DeviceMesh`` over the same rank layout (``parallel/mesh.py``), with a 1-D view per group kind."""
        if self._prepared is not None:
            return self._prepared.mesh
        if self._mesh is None:
            raise RuntimeError(
                "`MoEOverlapStrategy.parallel_mesh` is only available from the strategy's `setup` on (after "
                "`configure_model`); it was accessed before."
            )
        return self._mesh

    @property
    def pipeline_chunks(self) -> list[Module] | None:
        """At ``pp > 1``, the chunks of the model this rank holds (from ``setup`` on), in virtual-stage order; None at
        ``pp = 1``. The memory callbacks attach to them."""
        pipeline = None if self._prepared is None else self._prepared.pipeline
        return None if pipeline is None else pipeline.held_chunks

    @property
    def prepared(self) -> PreparedModel | None:
        """What ``setup`` built of the model, or took from an earlier run (``parallelize/prepared_model.py``): the
        mesh and groups, the comm runtime, the expert-parallel handle, the pipeline, the sharded units, the FP8 and
        pretrained-weight reports. None before ``setup``."""
        return self._prepared

    @property
    def runtime(self) -> CommRuntime:
        """The comm runtime of the model's MoE layers (delayed wgrad, observers); the prepared model's once set up."""
        return self._runtime if self._prepared is None else self._prepared.runtime

    @property
    def fp8_report(self) -> Float8Report | None:
        """What ``setup`` put in FP8 (None: ``fp8`` is None, or before ``setup``)."""
        return None if self._prepared is None else self._prepared.fp8

    @property
    def loaded_weights(self) -> HFLoadReport | None:
        """What this rank read of the module's ``hf_weights`` when the model was set up (None: it declares none)."""
        return None if self._prepared is None else self._prepared.loaded

    @property
    def checkpoint_format(self) -> CheckpointFormat:
        """How ``Trainer.save_checkpoint`` writes (``config.checkpoint_format``); may be set between saves, e.g.
        ``"consolidated"`` for one export at the end of a run (docs/checkpoints.md)."""
        return self.config.checkpoint_format  # type: ignore[return-value]

    @checkpoint_format.setter
    def checkpoint_format(self, checkpoint_format: CheckpointFormat) -> None:
        self._config = self._config.with_run_setting(checkpoint_format=checkpointer.check_format(checkpoint_format))

    @property
    def _timeout(self) -> timedelta:
        return _as_timedelta(self.config.timeout)

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Samples are split over the data-parallel group only: tp/cp/pp peers read the same samples."""
        coords = self.dims.coords(self.global_rank)
        return {"num_replicas": self.dims.dp, "rank": coords.dp}

    @property
    @override
    def precision_plugin(self) -> ExpertParallelPrecision:
        """The user's precision plugin, wrapped to clip gradients by the global norm (``precision.py``)."""
        return with_global_norm_clip(super().precision_plugin, self._clip_grad_by_norm)

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        plugin = None if precision_plugin is None else with_global_norm_clip(precision_plugin, self._clip_grad_by_norm)
        ParallelStrategy.precision_plugin.fset(self, plugin)  # type: ignore[attr-defined]

    @property
    def process_group_backend(self) -> str | None:
        return self.config.process_group_backend

    # -- launch and process groups ---------------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        world_size = self.num_nodes * self.num_processes
        device_type = self.parallel_devices[0].type if self.parallel_devices else "cpu"
        flex = check_flex(self.config, devices_per_node=self.num_processes, precision=self.precision_plugin.precision)
        raise_problems(check_world(self.config, world_size) + flex + check_machine(self.config, device_type))
        if self.config.start_method == "popen":
            self._launcher = ExpertParallelScriptLauncher(
                self,
                self.cluster_environment,
                self.num_processes,
                self.num_nodes,
                failure_grace_s=min(10.0, self._timeout.total_seconds()),
            )
        else:
            self._launcher = ExpertParallelSpawnLauncher(self, start_method=self.config.start_method)

    @override
    def setup_environment(self) -> None:
        """The processes, then the one mesh of the run and its groups, handed to the LightningModule before
        ``configure_model`` (``self.device_mesh`` as Lightning's ``ModelParallelStrategy`` does, and
        ``self.parallel_groups``)."""
        super().setup_environment()
        self._setup_distributed()
        quiet_third_party_noise(replica_fsdp=self.config.shard == "none", global_zero=self.is_global_zero)
        self._mesh = build_mesh(self.dims, self.root_device.type, backend=self._backend(), timeout=self._timeout)
        self._groups = self._mesh.process_groups(self.global_rank)
        pl_module = self.lightning_module
        if pl_module is not None:  # read by model code in `configure_model` (Lightning issue #20632)
            self._hand_to_module(pl_module, self._mesh, self._groups)
        log.debug("%s: %s", type(self).__name__, self.dims.describe())

    @staticmethod
    def _hand_to_module(module: Module, mesh: ParallelMesh, groups: ParallelGroups) -> None:
        module.parallel_groups = groups
        pl_compat.set_device_mesh(module, mesh.device_mesh)

    def _backend(self) -> str:
        return self.config.process_group_backend or pl_compat.default_process_group_backend(self.root_device)

    def _setup_distributed(self) -> None:
        pl_compat.reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        if "nccl" in self._backend():  # read when the NCCL process group is created, so before it
            default_nccl_error_handling()
        pl_compat.init_dist_connection(
            self.cluster_environment, self._backend(), timeout=self._timeout, device_id=device_id
        )
        destroy_process_groups_at_exit()

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    # -- model -----------------------------------------------------------------------------------------------
    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` builds on the meta device, at every pp: each rank then allocates only what it holds
        (its experts' slice, its dense tensors, its pipeline chunks; ``parallelize/materialize.py``), initialised with
        the LightningModule's ``init_module`` hook under the run's seed.

        Hugging Face's ``from_pretrained`` called there (``AutoModelForCausalLM.from_pretrained(folder)``, Lightning's
        place for large models) is recognised (``hf/pretrained.py``): on a local folder the model is built from its
        ``config.json`` on meta (float32 unless the call names a ``dtype``) and its weights are declared as the
        module's ``hf_weights`` (``HFWeights(folder, prefix=<its attribute path>.)``, next to any the module declares
        itself), so each rank reads only its part after sharding. A call the meta build cannot honour (a Hub id,
        ``device_map``, ``quantization_config``, ...), or a model that is no attribute of the module, runs as written
        with real tensors: each rank reads the whole checkpoint. Rank 0 logs once what was recognised and what ran as
        written (docs/hf_checkpoints.md, "from_pretrained in configure_model").

        A LightningModule with ``build_on_meta = False`` builds with real tensors instead, nothing intercepted; each
        rank then keeps its own values and frees what it does not hold (docs/pipeline.md, "Pretrained weights"). A
        model built in ``__init__`` is unaffected.
        """
        with meta_build(self.lightning_module, name=type(self).__name__, pp=self.config.pp):
            yield

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            automatic = self.lightning_module.automatic_optimization
            raise_problems(check_trainer(self.config, automatic_optimization=automatic))
        self._prepare()
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        hooks = None
        if fitting:
            pl_compat.optimizers_to_device(self.optimizers, self.root_device)
            fraction = self.config.offload_fraction
            if fraction is not None:  # a share of the state and update on the host
                self.optimizers = offload_optimizers(self.optimizers, fraction, self.root_device)
                rank_zero_info(f"{type(self).__name__}: {describe_offload(self.optimizers)} (rank 0)")
            hooks = self._step_hooks(trainer)
            pl_compat.set_skip_backward(trainer, True)
            self._loop_trainer = trainer
            self._accumulation = Accumulation(
                trainer.accumulate_grad_batches, self.lightning_module, self.config,
                dp_group=self.parallel_groups.dp, device=self.root_device,
            )  # fmt: skip
        self._path = self._build_step_path(hooks)

    def _prepare(self) -> None:
        """Parallelise the model (``parallelize_model``, every step in ``parallelize/steps.py``'s order) and leave the
        record with it, or take the record an earlier ``setup`` left (``parallelize/prepared_model.py``): ``fit`` ->
        ``validate`` / ``test`` / ``predict`` / ``fit`` set the strategy up again, with the same Trainer or a new
        one."""
        assert self.model is not None
        earlier = adopt(self.model, self.config, self.dims, owner=f"`{type(self).__name__}`")
        if earlier is None:
            self._prepared = None  # set up for another model before: this one takes this run's mesh and groups
            self._prepared = parallelize_model(
                self.lightning_module, self.config, self.parallel_mesh, self.parallel_groups, self._runtime,
                device=self.root_device, convert_precision=self.precision_plugin.convert_module,
            )  # fmt: skip
            record(self.model, self._prepared)
            if self._prepared.loaded is not None:  # Lightning's INFO log: shown by default, once
                rank_zero_info(f"{type(self).__name__}: {self._prepared.loaded.describe()} (rank 0)")
            return
        if earlier is not self._prepared:  # a new strategy: the module's layers use the prepared groups
            self._prepared = earlier
            self._hand_to_module(self.lightning_module, earlier.mesh, earlier.groups)
            if earlier.pipeline is None:  # this run's micro-batch count
                scale = aux_loss_scale(self.config.num_microbatches, self.dims, pipelined=False)
                earlier.ep_model.set_aux_loss_scale(scale)
        self.precision_plugin.convert_module(self.model)  # only this run's precision and device
        self.model_to_device()

    @property
    def _built(self) -> PreparedModel:
        """The prepared model, from ``setup`` on."""
        assert self._prepared is not None, "MoEOverlapStrategy: used before `setup`"
        return self._prepared

    def _build_step_path(self, hooks: StepHooks | None) -> StepPath:
        """The step methods' path: the micro-batch loop at ``pp = 1``, the pipeline schedule at ``pp > 1``; both
        run their micro-batches through one ``OverlapEngine`` when training (``hooks``: ``None`` outside ``fit``)."""
        prepared = self._built
        engine = None
        if hooks is not None:
            nets = safety_nets(self._timeout.total_seconds(), self._backend())
            engine = OverlapEngine(
                prepared.runtime, overlap=self.config.overlap, timeout_s=nets.wait_s, stall_timeout_s=nets.stall_s
            )
        if prepared.pipeline is None:
            loop = None if engine is None else MicroBatchLoop(hooks, engine, self.config.num_microbatches,
                                                              self.token_scope)  # fmt: skip
            return LoopPath(prepared.sharded.gather, loop)
        if engine is not None:
            accumulate = self._accumulation.batches if self._accumulation is not None else 1
            early = prepared.sharded.before_last_backward if prepared.sharded.early is not None else None
            prepared.pipeline.build_schedule(engine, self.root_device, self.token_scope, accumulate=accumulate,
                                             before_last_backward=early)  # fmt: skip
            prepared.sharded.divide_gradients(prepared.pipeline.grad_divisor)
            self._set_pipeline_aux_scale(accumulate)
        return PipelinePath(prepared.pipeline, self.lightning_module, self.root_device, hooks,
                            self.precision_plugin.train_step_context, self.token_scope,
                            thread_ring=prepared.thread_ring)  # fmt: skip

    def _set_pipeline_aux_scale(self, accumulate: int) -> None:
        """At pp > 1 the routers' auxiliary-loss weight follows the schedule's: 1 where torch divides the gradients
        by M, ``1 / (M * A)`` where the losses are weighted instead (``pipeline/step_loss.py``)."""
        prepared = self._built
        assert prepared.pipeline is not None
        weighted = accumulate > 1 or prepared.pipeline.split.token_loss
        pipelined_scale = aux_loss_scale(self.config.num_microbatches, self.dims, pipelined=True)
        prepared.ep_model.set_aux_loss_scale(
            pipelined_scale / (self.config.num_microbatches * accumulate) if weighted else pipelined_scale
        )

    @override
    def on_train_start(self) -> None:
        """The training dataloader's rules (``validation.check_train_loaders``), once the Trainer has prepared it
        and before the first step: a short last batch at pp > 1 is refused now, not at the end of the epoch. The
        SIGTERM handler that never runs a collective (``processes/signals.py``) is put in place."""
        super().on_train_start()
        self._signals.install(self.lightning_module.trainer)
        raise_problems(check_train_loaders(self.config, self.lightning_module.trainer.train_dataloader))

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._signals.install(self.lightning_module.trainer)

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self._signals.install(self.lightning_module.trainer)

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._signals.install(self.lightning_module.trainer)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Every rank agrees first whether a SIGTERM arrived since the last batch (one all-reduce of a flag); if
        one did, every rank stops here together (``processes/signals.py``), once the checkpoint being written in
        the background (if any) is committed."""
        try:
            self._signals.agree(self.root_device)
        except SIGTERMException:
            self.wait_for_checkpoint()  # every rank is here, no step collective in flight: the save completes
            raise
        return super().batch_to_device(batch, device, dataloader_idx)

    def _step_hooks(self, trainer: Trainer) -> StepHooks:
        """What the micro-batch loop needs of the strategy and Lightning, as callables (``loop.py``)."""
        module = self.lightning_module

        def zero_grad(batch_idx: int) -> None:
            pl_compat.zero_grad(trainer, batch_idx, trainer.optimizers[0])
            self._built.sharded.begin_step()

        def forward(micro_batch: Any, batch_idx: int, *rest: Any) -> Any:
            # on the thread that runs it (an engine lane, with overlap): this thread's attention through the ring
            with self._built.thread_ring(), self.precision_plugin.train_step_context():
                return plain_step_output(module.training_step(micro_batch, batch_idx, *rest))

        def backward(loss: Tensor) -> None:
            self.backward(loss, trainer.optimizers[0])

        return StepHooks(
            zero_grad=zero_grad,
            forward=forward,
            backward=backward,
            sync_gradients=self.sync_gradients,
            capture_logs=lambda: MicroBatchLogs(module),
            aux_loss_scale=self._built.scale_aux_loss,
            before_last_backward=lambda: self._built.sharded.before_last_backward(),
            token_loss=lambda batch, token_sum: self._accumulation.batch_loss(batch, token_sum),
        )

    @override
    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any],
        model: Module | None = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        prepared = self._built
        if prepared.fp8 is not None and prepared.fp8.float8_all_gather:
            precompute_float8_scales(self.model)  # the next all-gather's float8 scales, in one all-reduce
        prepared.sharded.after_optimizer_step()
        prepared.ep_model.update_expert_bias(prepared.groups.dp_cp_tp)
        if prepared.placer is not None and prepared.placer.has_replicas:  # the replicas take the updated weights
            prepared.placer.refresh_replicas()
        return output

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """With ``accumulate_grad_batches > 1``, the training dataloader read ahead by an accumulation window
        (``accumulation.LookaheadLoader``): a window's token count needs its later batches before its first step."""
        trainer = pl_compat.attached_trainer(self.lightning_module) if self.lightning_module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING or trainer.accumulate_grad_batches == 1:
            return dataloader
        assert self._accumulation is not None
        return self._accumulation.read_ahead(dataloader)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        place_model(self.model, None if self._prepared is None else self._prepared.pipeline, self.root_device)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._loop_trainer is None:  # not in fit: Lightning's own step
            with self._built.loss_scope():
                return super().training_step(*args, **kwargs)
        assert self._accumulation is not None
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        window = self._accumulation.window(self._loop_trainer, args[0], batch_idx)
        with self._built.step_scope():
            return self._step_path().train(*args, window=window, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate(super().validation_step, self.precision_plugin.val_step_context, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate(super().test_step, self.precision_plugin.test_step_context, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step_path().predict(super().predict_step, *args, **kwargs)

    def _evaluate(self, user_step: Callable[..., Any], context: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
        """An evaluation step through the step path; the module shards its batch as in training, so the step runs in
        the ring at cp > 1 and under ``loss_parallel`` at tp > 1 (``PreparedModel.step_scope``)."""
        prepared = self._built

        def step(*step_args: Any, **step_kwargs: Any) -> Any:
            with prepared.thread_ring():
                return user_step(*step_args, **step_kwargs)

        with prepared.step_scope():
            return self._step_path().evaluate(step, context, *args, **kwargs)

    def _step_path(self) -> StepPath:
        assert self._path is not None, "a step before MoEOverlapStrategy.setup"
        return self._path

    def sync_gradients(self) -> None:
        """Average gradients over the data-parallel groups (called once per step, after the last micro-batch): FSDP's
        all-reduce (``"none"``, plus the experts' over edp, ``parallel/grads.py``) or reduce-scatter
        (``parallelize/sharding.py``).
        """
        prepared, tp_grads = self._built, self._built.tp_grads
        # before FSDP reduces over dp x cp: the replicas' sum over their tp shards (with `overlap_grad_reduce`, of
        # those whose unit was not reduced during the backward)
        prepared.sharded.end_step(before_rest=None if tp_grads is None else lambda: tp_grads.reduce(self.model))
        if prepared.placer is not None and prepared.placer.has_replicas:  # before the sums over data parallelism
            divisor = 1 if prepared.pipeline is None else prepared.pipeline.schedule_divisor
            prepared.placer.sum_replica_gradients(divisor)
        if not prepared.sharded.sharded:
            prepared.ep_model.sync_expert_gradients(prepared.groups)

    def global_grad_norm(self) -> Tensor:
        """The L2 norm of all gradients of the model across every rank (float64 on the root device, the same on
        every rank)."""
        params = [p for p in self._built.sharded.parameters if p.requires_grad]
        return global_grad_norm(params, block=self._replica_size, device=self.root_device)

    def _clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, max_norm: float) -> None:
        """Clip the optimizer's gradients by the norm over all ranks (``ExpertParallelPrecision`` calls it)."""
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        clip_grad_norm(params, max_norm, block=self._replica_size, device=self.root_device)

    @property
    def _replica_size(self) -> int:
        """Ranks that together hold one copy of the model (those of a pp stage): ``dp * cp * tp``."""
        dims = self.dims
        return dims.dp * dims.cp * dims.tp

    def held_tensors(self) -> dict[str, Tensor]:
        """``{unsplit name: tensor}`` of every parameter and persistent buffer this rank holds, from ``setup`` on
        (plain or ``DTensor``; at ``pp > 1`` its own chunks'): what a checkpoint loader fills
        (``parallelize/held_tensors.py``)."""
        return held_tensors(self.lightning_module, self._built.pipeline)

    def global_shapes(self) -> dict[str, tuple[int, ...]]:
        """``{unsplit name: global shape}`` of every parameter and persistent buffer of the whole model, held here
        or not (``parallelize/held_tensors.py``)."""
        return global_shapes(self.lightning_module)

    # -- checkpoints (docs/checkpoints.md): layout-free state, sharded or consolidated, committed atomically ------
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Restore once the experts are sharded, so each rank reads exactly the experts it holds now."""
        return True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's module state through ``get_model_state_dict``: the held tensors, keyed by the unsplit
        model's names, experts as ``DTensor`` s of global shape ``[E, ...]`` (logical: re-placed experts are moved
        back first, and to their placement again once the checkpoint is written)."""
        self._experts_logical()
        return checkpointer.module_state(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's optimizer state through ``get_optimizer_state_dict`` (flat, keyed by parameter name)."""
        return checkpointer.optimizer_state(optimizer, self.lightning_module)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike, storage_options: Any | None = None
    ) -> None:
        """Collective: every rank writes its part (``checkpoint_format``); committed only when all have written."""
        if storage_options is not None:
            raise TypeError(
                f"`MoEOverlapStrategy.save_checkpoint`: `storage_options={storage_options!r}` is not supported; the "
                "strategy writes its checkpoints itself (no `CheckpointIO`). Pass no storage options and choose the "
                "format with `checkpoint_format`."
            )
        checkpointer.save(checkpoint, filepath, self.config.checkpoint_format, self.lightning_module, self.optimizers,
                          self.parallel_groups, background=self._background_saves())  # fmt: skip
        if self._prepared is not None:  # `state_dict()` leaves `fully_shard`'s modules sharded
            self._prepared.sharded.release()
            self._experts_placed()  # written (or staged): the experts go back to their placement

    @property
    def saves_in_background(self) -> bool:
        """Whether saves during ``fit`` / ``validate`` / ... write in the background: ``async_save=True``, or
        Lightning's ``AsyncCheckpointIO`` among the Trainer's plugins (docs/checkpoints.md, "Saving in the
        background")."""
        return self.config.async_save or isinstance(self.checkpoint_io, AsyncCheckpointIO)

    def wait_for_checkpoint(self) -> None:
        """Block until the checkpoint being written in the background (if any) is committed under its name; raises
        its error if it failed. Every rank calls it (a load, a removal, the next save and the run's end do)."""
        if self._saves is not None:
            self._saves.wait()

    def _background_saves(self) -> BackgroundSaves | None:
        """The run's background saves while a Trainer runs with them on; ``None`` (a synchronous save) otherwise."""
        trainer = pl_compat.attached_trainer(self.lightning_module)
        if not self.saves_in_background or trainer is None or trainer.state.status != TrainerStatus.RUNNING:
            return None
        if self._saves is None:
            self._saves = BackgroundSaves(_as_timedelta(self.config.timeout))
        return self._saves

    @override
    def load_checkpoint(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        """This rank's part of a sharded directory or consolidated file, in the layout it holds now (any layout).

        ``weights_only`` (``None`` means ``True``, as in ``torch.load``): every file is read without running code
        from it, and one that needs more is refused with its name; ``False`` unpickles without restriction, for
        checkpoints from a trusted source only. Lightning 2.6 passes ``None`` here whatever ``trainer.fit`` was
        given (this strategy restores after setup); with the Trainer, opt out with
        ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` (docs/checkpoints.md).
        """
        self.wait_for_checkpoint()
        module = self.lightning_module
        assert module is not None
        trainer = pl_compat.attached_trainer(module)
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        if self._prepared is not None and self._prepared.placer is not None:
            self._prepared.placer.reset(self.optimizers)  # a checkpoint is logical: it loads into the identity
        checkpoint = checkpointer.load(
            checkpoint_path, module, self.optimizers, strict=module.strict_loading, restore_rng_state=fitting,
            weights_only=weights_only,
        )
        # an epoch-end checkpoint resumes at the next epoch's first batch (docs/checkpoints.md, "Resuming exactly")
        return pl_compat.finish_saved_epoch(checkpoint) if fitting else checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        checkpointer.load_module_state(self.lightning_module, dict(checkpoint), strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        checkpointer.load_optimizer_states(self.optimizers, self.lightning_module, dict(checkpoint))

    @override
    def remove_checkpoint(self, filepath: str | os.PathLike) -> None:
        self.wait_for_checkpoint()  # the one being written may be the one removed
        checkpointer.remove(filepath, self.global_rank)

    def full_state_dict(self) -> dict[str, Any] | None:
        """The unsharded module state (every expert in the full ``[E, ...]`` layout) on global rank 0, None elsewhere.

        Collective: every rank must call it. Loads into the model as built before the strategy sharded it.
        """
        self._experts_logical()
        state = checkpointer.full_model_state(self.lightning_module, self.parallel_groups)
        self._experts_placed()
        return state

    def expert_placer(self) -> ExpertPlacer:
        """The experts' placements (``parallelize/expert_placer.py``), from ``setup`` on;
        :class:`~lightning_moe_overlap.callbacks.ExpertBalance` drives it (docs/expert_placement.md)."""
        placer = self._built.placer
        assert placer is not None
        return placer

    def rebalance_experts(
        self, step: int, min_gain: float = 0.0, replicas: int = 0, within_nodes: bool = True
    ) -> PlacementReport:
        """Re-place the experts from the tokens counted since the last call, with ``replicas`` replica slots per
        experts module; ``within_nodes``: when the ep group spans nodes, no expert leaves its node (collective, at
        a step boundary)."""
        group = self._built.groups.ep
        nodes = None
        if within_nodes and group is not None and self.num_nodes > 1:
            nodes = [rank // self.num_processes for rank in dist.get_process_group_ranks(group)]
        return self.expert_placer().rebalance(step, self.optimizers, min_gain, replicas, nodes)

    def _experts_logical(self) -> None:
        """Re-placed experts back to the identity before a state dict is read (collective; nothing otherwise)."""
        if self._prepared is not None and self._prepared.placer is not None:
            self._prepared.placer.to_logical(self.optimizers)

    def _experts_placed(self) -> None:
        if self._prepared is not None and self._prepared.placer is not None:
            self._prepared.placer.restore(self.optimizers)

    def export_hf(
        self,
        dst: str | os.PathLike,
        *,
        config: Any = None,
        prefix: str | None = None,
        family: str | None = None,
        max_shard_bytes: int | str = DEFAULT_SHARD,
        dtype: torch.dtype | None = None,
        overwrite: bool = False,
    ) -> ExportReport:
        """Write the live model as a Hugging Face checkpoint folder, each rank writing the tensors it holds (no rank
        gathers the model; ``hf/sharded_export.py``). Collective: every rank calls it, after ``setup``.

        Args:
            dst: the folder (on a file system every rank sees; new or empty unless ``overwrite``).
            config: the model's config (a ``PretrainedConfig``, a ``config.json`` or its folder); default: the config
                of the LightningModule's Hugging Face model, and its ``generation_config`` as
                ``generation_config.json``.
            prefix: where the HF model sits in the LightningModule's names; default: found (``"model."`` for
                ``self.model``).
            family, max_shard_bytes, dtype, overwrite: as :func:`~lightning_moe_overlap.hf.export.export_hf`.

        Returns:
            What this rank wrote (:class:`~lightning_moe_overlap.hf.sharded_export.ExportReport`).

        Raises:
            ValueError: no config given and the LightningModule holds no Hugging Face decoder; the errors of
                :func:`~lightning_moe_overlap.hf.sharded_export.export_hf_sharded` (every rank raises them).
        """
        module = self.lightning_module
        found_prefix, hf_model = hf_model_path(module)
        if config is None and hf_model is None:
            raise ValueError(
                f"`MoEOverlapStrategy.export_hf`: `{type(module).__name__}` holds no Hugging Face causal LM to take "
                "the config from. Rule: the Hub folder needs the model's config.json. Fix: pass `config=` (a "
                "`PretrainedConfig`, a config.json or the folder the run started from) and `prefix=`."
            )
        generation = getattr(hf_model, "generation_config", None) if config is None else None
        self._experts_logical()  # a failed export leaves them there: correct, only not balanced until re-placed
        report = export_hf_sharded(
            self.held_tensors(), self.global_shapes(), dst, config=hf_model.config if config is None else config,
            family=family, prefix=found_prefix if prefix is None else prefix, max_shard_bytes=max_shard_bytes,
            dtype=dtype, overwrite=overwrite, generation_config=generation,
        )  # fmt: skip
        self._experts_placed()
        return report

    # -- collectives -----------------------------------------------------------------------------------------
    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        if isinstance(tensor, Tensor):
            return pl_compat.sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def barrier(self, name: str | None = None) -> None:
        if not pl_compat.distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not pl_compat.distributed_is_initialized():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src)
        return holder[0]

    @override
    def teardown(self) -> None:
        self._signals.uninstall()
        failed_save = self._finish_saves()
        try:
            self._teardown()
        finally:
            if failed_save is not None:
                raise failed_save

    def _finish_saves(self) -> RuntimeError | None:
        """The end of a run: the checkpoint in flight is written and committed (a run stopped by a signal committed
        it before its ranks stopped: ``batch_to_device``). Its failure is returned (to raise after the teardown) or,
        when the run failed (its process groups may be gone), logged. Where the run ended normally, every rank waits
        for the commit, so every rank sees it."""
        saves, self._saves = self._saves, None
        if saves is None:
            return None
        try:
            saves.close()
        except RuntimeError as err:
            if not self._failed:
                return err
            log.warning(str(err))
            return None
        if not self._failed:
            self.barrier("checkpoint committed")
        return None

    def _teardown(self) -> None:
        if self._loop_trainer is not None:
            pl_compat.set_skip_backward(self._loop_trainer, False)
            self._loop_trainer = None
        self._accumulation = None
        self._path = None
        pipeline = None if self._prepared is None else self._prepared.pipeline
        if self._prepared is not None and not self._failed:
            self._prepared.sharded.release()
        if pipeline is None and not self._failed:
            super().teardown()
            return
        # Strategy.teardown without moving the whole module: at pp > 1 the other pp ranks' chunks stay on meta; after
        # a failure the modules stay as the step left them (FSDP's parameters gathered mid-step: moving them fails)
        if not self._failed:
            pl_compat.optimizers_to_device(self.optimizers, torch.device("cpu"))
            assert pipeline is not None
            pipeline.place(torch.device("cpu"), seed=torch.initial_seed())
        self.precision_plugin.teardown()
        assert self.accelerator is not None and self.cluster_environment is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
        self.cluster_environment.teardown()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        super().on_exception(exception)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: pl_compat.StrategyRegistry) -> None:
        for name, start_method in (("moe_overlap", "popen"), ("moe_overlap_spawn", "spawn")):
            if name not in strategy_registry:
                strategy_registry.register(
                    name,
                    cls,
                    description=f"MoE expert-parallel all-to-all overlap, processes started with '{start_method}'",
                    start_method=start_method,
                )


def _as_timedelta(timeout: float | timedelta | None) -> timedelta:
    if timeout is None:
        return pl_compat.default_pg_timeout
    if isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(
            f"`MoEOverlapStrategy`: `timeout={timeout!r}` must be a positive number of seconds or a timedelta."
        )
    return timedelta(seconds=float(timeout))
