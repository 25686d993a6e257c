"""What the strategy's ``setup`` made of a model, kept on the model so that every later run takes it as it is.

``setup`` changes the user's model in place: its experts become expert-parallel modules holding this rank's experts
(``moe/adapters.py``), ``fully_shard`` turns its parameters into ``DTensor`` s (``parallel/sharding.py``), and at
``pp > 1`` it is cut into chunks (``pipeline/pipelined.py``). None of that can run twice on the same model, and
``fit`` -> ``validate`` / ``test`` / ``predict`` / ``fit`` (with the same Trainer or a new one) sets the strategy up
again. So the first ``setup`` records what it built on the model (:func:`record`), and a later ``setup`` adopts it
(:func:`recorded`) after checking that it asks for the same layout (:func:`check_same_layout`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from torch import nn

from lightning_moe_overlap.config import OverlapConfig
from lightning_moe_overlap.overlap.runtime import CommRuntime
from lightning_moe_overlap.parallel import ParallelDims, ParallelGroups
from lightning_moe_overlap.parallel.mesh import ParallelMesh
from lightning_moe_overlap.parallel.sharding import ShardedModel
from lightning_moe_overlap.parallel.tensor import TensorParallelGrads

if TYPE_CHECKING:
    from lightning_moe_overlap.pipeline.pipelined import PipelinedModel
    from lightning_moe_overlap.moe.handle import MoEModelHandle

_ATTRIBUTE = "moe_overlap_prepared"
# Settings a later run may change: how processes start, whether `overlap` was set (it decides warnings only), and at
# pp = 1 the micro-batch schedule (built per run).
_PER_RUN = ("start_method", "overlap_requested")
_PER_RUN_AT_PP1 = ("overlap", "num_microbatches")


@dataclass(frozen=True)
class PreparedModel:
    """The strategy's collaborators for one model, as its first ``setup`` built them."""

    config: OverlapConfig
    dims: ParallelDims
    groups: ParallelGroups
    mesh: ParallelMesh
    runtime: CommRuntime
    ep_model: MoEModelHandle
    pipeline: PipelinedModel | None
    sharded: ShardedModel
    tp_grads: TensorParallelGrads | None = None


def record(model: nn.Module, prepared: PreparedModel) -> None:
    """Keep ``prepared`` on ``model`` (a plain attribute: not a submodule, parameter or buffer, not in its state)."""
    model.__dict__[_ATTRIBUTE] = prepared


def recorded(model: nn.Module) -> PreparedModel | None:
    """What an earlier ``setup`` recorded on ``model``, or None."""
    return model.__dict__.get(_ATTRIBUTE)


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
        changed.append(f"the world {dims.describe()} (prepared on {prepared.dims.describe()})")
    if changed:
        raise NotImplementedError(
            f"{owner}: the model was already made expert-parallel in place by an earlier run's strategy, and this "
            f"run asks for another layout: {', '.join(changed)}. A model is prepared once, so a later `fit`, "
            "`validate`, `test` or `predict` must use the same settings. Use the earlier settings, or build a new "
            "model and load the trained weights into it from a checkpoint (`trainer.save_checkpoint(path)`, then "
            "`ckpt_path=path`; checkpoints load at any layout)."
        )
