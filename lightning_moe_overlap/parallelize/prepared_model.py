"""What the strategy's ``setup`` made of a model: one record, which the strategy holds and the model carries.

``setup`` changes the user's model in place: its experts become expert-parallel modules holding this rank's experts
(``moe/adapters.py``), ``fully_shard`` turns its parameters into ``DTensor`` s (``parallelize/sharding.py``), and at
``pp > 1`` it is cut into chunks (``pipeline/pipelined.py``). None of that can run twice on the same model, and
``fit`` -> ``validate`` / ``test`` / ``predict`` / ``fit`` (with the same Trainer or a new one, whose strategy is a new
object) sets the strategy up again. So the first ``setup`` builds a :class:`PreparedModel` (``parallelize/steps.py``,
``parallelize_model``), the strategy reads every collaborator from it (it keeps no copy of its fields), and
:func:`record` leaves it with the model; a later ``setup`` takes it back with :func:`adopt` after checking that it
asks for the same layout.

Where the record lives. It must outlive the strategy (a new Trainer's strategy finds it) and die with the model. A
``WeakKeyDictionary`` keyed by the model cannot do that here: the record holds the model (its handle, its FSDP
roots), and a dictionary's values are strong references, so the model would never be freed. The record is
therefore one plain attribute of the model object (:data:`ATTRIBUTE`, not a submodule, parameter or buffer, not in
its ``state_dict``), read and written only here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from torch import nn

from lightning_moe_overlap.config import OverlapConfig
from lightning_moe_overlap.loss.vocab_parallel import loss_parallel_scope
from lightning_moe_overlap.moe.adapters import expert_parallel_modules
from lightning_moe_overlap.overlap.runtime import CommRuntime
from lightning_moe_overlap.parallel import ParallelDims, ParallelGroups
from lightning_moe_overlap.parallel.context_module import ContextParallel
from lightning_moe_overlap.parallel.mesh import ParallelMesh
from lightning_moe_overlap.parallelize.sharding import ShardedModel
from lightning_moe_overlap.parallelize.tensor_plan import TensorParallelGrads

if TYPE_CHECKING:
    from lightning_moe_overlap.fp8.apply import Float8Report
    from lightning_moe_overlap.hf.load import HFLoadReport
    from lightning_moe_overlap.moe.model_handle import MoEModelHandle
    from lightning_moe_overlap.parallelize.expert_placer import ExpertPlacer
    from lightning_moe_overlap.pipeline.pipelined import PipelinedModel

ATTRIBUTE = "moe_overlap_prepared"
# Settings a later run may change: how processes start, whether `overlap` was set (it decides warnings only), the
# checkpoint format and whether saves run in the background, the collectives' timeout, the optimizer offload (the
# optimizer is built per run), and at pp = 1 the micro-batch schedule (built per run).
_PER_RUN = ("start_method", "overlap_requested", "checkpoint_format", "async_save", "timeout",
            "optimizer_cpu_offload", "optimizer_offload_fraction")  # fmt: skip
_PER_RUN_AT_PP1 = ("overlap", "num_microbatches")


@dataclass(frozen=True)
class PreparedModel:
    """The strategy's collaborators for one model, as its first ``setup`` built them.

    ``cp``: the module's context-parallel handle at ``cp > 1``; ``fp8``: what was put in FP8 (None without ``fp8``);
    ``loaded``: what this rank read of the module's ``hf_weights`` (None when it declares none); ``compiled``: the
    names of the modules whose forward ``compile=True`` compiled on this rank."""

    config: OverlapConfig
    dims: ParallelDims
    groups: ParallelGroups
    mesh: ParallelMesh
    runtime: CommRuntime
    ep_model: MoEModelHandle
    pipeline: PipelinedModel | None
    sharded: ShardedModel
    tp_grads: TensorParallelGrads | None = None
    cp: ContextParallel | None = None
    fp8: Float8Report | None = None
    loaded: HFLoadReport | None = None
    placer: ExpertPlacer | None = None  # the experts' placements (`expert_placer.py`)
    compiled: tuple[str, ...] = ()  # the modules whose forward runs compiled (`compile=True`, `compile_regions.py`)

    # -- what a step enters, and the routers' balancing-loss weight ---------------------------------------------
    def loss_scope(self) -> AbstractContextManager[None]:
        """At ``tp > 1``, torch's ``loss_parallel``: its cross-entropy handlers for vocabulary-sharded logits are
        process-wide (``DTensor``'s op dispatcher, not thread-local), so entered on the main thread around a step's
        forwards and backwards they cover the engine's lanes; not re-entrant, left when a step fails
        (``loss_parallel_scope``). Nothing at ``tp = 1``."""
        return nullcontext() if self.dims.tp == 1 else loss_parallel_scope()

    @contextmanager
    def step_scope(self) -> Iterator[None]:
        """Entered on the main thread around a step's forwards and backwards: :meth:`loss_scope`, and at ``cp > 1``
        torch's process-wide ring handlers (``ContextParallelAttention.enabled``)."""
        with nullcontext() if self.cp is None else self.cp.attention.enabled(), self.loss_scope():
            yield

    def thread_ring(self) -> AbstractContextManager[None]:
        """At ``cp > 1``, the ring for the SDPA calls of the calling thread (an engine lane runs each micro-batch on
        its own; ``thread_context``); nothing at ``cp = 1``."""
        return nullcontext() if self.cp is None else self.cp.attention.thread_context()

    def scale_aux_loss(self, scale: float) -> None:
        """The routers' auxiliary-loss weight of the next forwards: ``scale`` (the loop's ``1 / M``) times ``cp``
        (``parallelize/steps.py``'s ``aux_loss_scale``)."""
        self.ep_model.set_aux_loss_scale(scale * self.dims.cp)


def record(model: nn.Module, prepared: PreparedModel) -> None:
    """Leave ``prepared`` with ``model`` for a later ``setup`` (see the module docstring for where)."""
    model.__dict__[ATTRIBUTE] = prepared


def adopt(model: nn.Module, config: OverlapConfig, dims: ParallelDims, owner: str) -> PreparedModel | None:
    """What an earlier ``setup`` built for ``model``, checked against this run's ``config`` and ``dims``; None for a
    model not set up yet.

    Raises:
        NotImplementedError: this run asks for another layout than the model was prepared with.
        RuntimeError: the model has expert-parallel experts that no strategy recorded (``apply_expert_parallel`` ran
            on it by hand).
    """
    prepared = model.__dict__.get(ATTRIBUTE)
    if prepared is None:
        wrapped = expert_parallel_modules(model)
        if wrapped:
            raise RuntimeError(
                f"{owner}: `{type(model).__name__}` already has expert-parallel experts "
                f"({', '.join(wrapped[:3])}{', ...' if len(wrapped) > 3 else ''}) that this strategy did not "
                "build (`apply_expert_parallel` ran on it); the strategy makes a model expert-parallel itself, "
                "once. Pass the model as built, before `apply_expert_parallel`."
            )
        return None
    check_same_layout(prepared, config, dims, owner)
    return prepared


def check_same_layout(prepared: PreparedModel, config: OverlapConfig, dims: ParallelDims, owner: str) -> None:
    """Raise unless ``config`` and ``dims`` build what ``prepared`` holds (the settings of a run excepted).

    Raises:
        NotImplementedError: a setting that shapes the model differs from the one it was prepared with.
    """
    per_run = _PER_RUN + (_PER_RUN_AT_PP1 if config.pp == 1 else ())
    changed = [
        f"{f.name}={getattr(config, f.name)!r} (prepared with {getattr(prepared.config, f.name)!r})"
        for f in fields(OverlapConfig)
        if f.name not in per_run and getattr(config, f.name) != getattr(prepared.config, f.name)
    ]
    if dims != prepared.dims:
        changed.append(f"{dims.describe()} (prepared on {prepared.dims.describe()})")
    if changed:
        raise NotImplementedError(
            f"{owner} (rule `prepared-layout`, docs/validation.md): the model was already made expert-parallel in "
            f"place by an earlier run's strategy, and this run asks for another layout: {'; '.join(changed)}. A "
            "model is prepared once, so a later `fit`, "
            "`validate`, `test` or `predict` must use the same settings. Use the earlier settings, or build a new "
            "model and load the trained weights into it from a checkpoint (`trainer.save_checkpoint(path)`, then "
            "`ckpt_path=path`; checkpoints load at any layout)."
        )
