"""The strategy's settings as one frozen value, so validation and the ``check`` command read the same thing.

The option sets are spelled once, here, as ``Literal`` types (the strategy's signature uses them, so LightningCLI
offers exactly these) and as tuples derived from them (what validation and the factories check against).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, get_args

Dispatcher = Literal["alltoall", "allgather", "flex"]
FlexBackend = Literal["deepep"]
DropPolicy = Literal["probs", "position"]
StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
ExpertBackend = Literal["torch", "te"]
CheckpointFormat = Literal["sharded", "consolidated"]
PipelineSchedule = Literal["1f1b", "interleaved_1f1b", "dualpipev", "zero_bubble"]
ShardMode = Literal["none", "optimizer", "full"]

DISPATCHERS: tuple[str, ...] = get_args(Dispatcher)
FLEX_BACKENDS: tuple[str, ...] = get_args(FlexBackend)
DROP_POLICIES: tuple[str, ...] = get_args(DropPolicy)
START_METHODS: tuple[str, ...] = get_args(StartMethod)
EXPERT_BACKENDS: tuple[str, ...] = get_args(ExpertBackend)
CHECKPOINT_FORMATS: tuple[str, ...] = get_args(CheckpointFormat)
PIPELINE_SCHEDULES: tuple[str, ...] = get_args(PipelineSchedule)
SHARD_MODES: tuple[str, ...] = get_args(ShardMode)
# Overlapped by default at pp > 1: interleaved 1F1B's pairs chain the pp ranks (each needs what the other rank's
# previous pair sends) and still leave one rank idle for a quarter of the step with overlap (docs/benchmarks.md,
# "Pipeline parallelism"), so it overlaps only when asked.
OVERLAP_BY_DEFAULT: tuple[str, ...] = ("dualpipev",)


def default_schedule(vpp: int | None) -> str:
    """``1f1b`` at one stage per rank, ``interleaved_1f1b`` with virtual stages."""
    return "1f1b" if (vpp or 1) == 1 else "interleaved_1f1b"


def resolve_overlap(
    overlap: bool | None, num_microbatches: object, *, pp: object = 1, schedule: str | None = None
) -> bool:
    """``overlap=None`` (the strategy's default) means on whenever there is a second micro-batch to overlap with
    and, at ``pp > 1``, the schedule is one whose pairs keep the pipeline busy (``OVERLAP_BY_DEFAULT``)."""
    if overlap is not None:
        return overlap
    several = isinstance(num_microbatches, int) and not isinstance(num_microbatches, bool) and num_microbatches > 1
    return several and (pp == 1 or schedule in OVERLAP_BY_DEFAULT)


@dataclass(frozen=True)
class OverlapConfig:
    """Everything :class:`MoEOverlapStrategy` was asked for, every setting of its constructor but Lightning's own
    plugins (accelerator, devices, cluster environment, checkpoint IO, precision); see the strategy's docstring for
    each field. The one value that validation, the ``check`` command and a later run's layout check
    (``parallelize/prepared_model.py``) read."""

    ep: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    dispatcher: str = "alltoall"
    flex_backend: str | None = None
    overlap: bool | None = True  # None (the strategy's default): resolved on construction, a bool afterwards
    delay_wgrad: bool = False
    num_microbatches: int = 1
    capacity_factor: float | None = None
    token_drop_policy: str = "probs"
    shared_expert_overlap: bool = False
    deepep_num_sms: int = 20
    alltoall_dedup: bool = False
    alltoall_static: bool = False
    compile: bool = False
    process_group_backend: str | None = None
    start_method: str = "popen"
    expert_backend: str = "torch"
    pipeline_schedule: str | None = None
    pipeline_layout: str | None = None
    shard: str = "none"
    sequence_parallel: bool = True
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    token_mean_over_dp: bool = False
    fp8: str | None = None
    fsdp_mp_policy: Any = None  # torch's `MixedPrecisionPolicy` (a frozen dataclass, compared by value) or None
    checkpoint_format: str = "sharded"
    async_save: bool = False
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0
    timeout: float | timedelta | None = None
    # what was asked for `overlap` before resolution: None when left unset (warnings about it speak only to a
    # user who set it)
    overlap_requested: bool | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        object.__setattr__(self, "overlap_requested", self.overlap)
        if self.overlap is None:
            try:
                schedule = self.resolved_schedule if self.pp != 1 else None
            except (TypeError, ValueError):  # a bad layout string: validation reports it
                schedule = None
            object.__setattr__(self, "overlap", resolve_overlap(None, self.num_microbatches, pp=self.pp,
                                                                schedule=schedule))  # fmt: skip

    def with_run_setting(self, **changes: Any) -> OverlapConfig:
        """This configuration with ``changes`` (settings a run may change, e.g. ``checkpoint_format``), keeping what
        was asked for ``overlap`` (``dataclasses.replace`` would take the resolved value for it)."""
        changed = dataclasses.replace(self, **changes)
        object.__setattr__(changed, "overlap_requested", self.overlap_requested)
        return changed

    @property
    def offload_fraction(self) -> float | None:
        """The share of the parameters' elements whose optimizer state lives on the host; None without offload."""
        return self.optimizer_offload_fraction if self.optimizer_cpu_offload else None

    @property
    def resolved_vpp(self) -> int:
        """Chunks per pp rank: ``vpp``, else the layout's chunks / ``pp``, else 1."""
        if self.vpp is not None:
            return self.vpp
        if self.pipeline_layout is not None and isinstance(self.pp, int) and self.pp >= 1:
            from lightning_moe_overlap.config.pipeline_layout import parse_layout

            chunks = len(parse_layout(self.pipeline_layout))
            return max(1, chunks // self.pp)
        return 1

    @property
    def resolved_schedule(self) -> str:
        """The pipeline schedule in effect: ``pipeline_schedule``, else the default for the chunks per rank."""
        return self.pipeline_schedule or default_schedule(self.resolved_vpp)

    @property
    def resolved_flex_backend(self) -> str | None:
        """The flex backend in effect: ``deepep`` by default once ``dispatcher="flex"``."""
        if self.dispatcher != "flex":
            return None
        return self.flex_backend or "deepep"
