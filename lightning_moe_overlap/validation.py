"""Validation rules, checked before anything is spawned or any collective runs.

Each rule is a small function that returns the problems it finds. A problem names the values, the rule and the fix.
Rules run identically on every rank (they read only the configuration, the world size and the model's structure),
so a bad configuration fails on every rank with the same message instead of hanging in a collective.
``docs/validation.md`` lists every rule with its reason.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import DataLoader

from lightning_moe_overlap._checks import divisors, is_positive_int
from lightning_moe_overlap._install import install_hint
from lightning_moe_overlap.config import (
    DISPATCHERS,
    EXPERT_BACKENDS,
    FLEX_BACKENDS,
    PIPELINE_SCHEDULES,
    SHARD_MODES,
    START_METHODS,
    OverlapConfig,
)
from lightning_moe_overlap.fp8.apply import MIN_CUDA_CAPABILITY
from lightning_moe_overlap.fp8.dense import linear_align, plan_linears
from lightning_moe_overlap.float8.recipes import NEEDS_TE, RECIPES

MXFP8 = "mxfp8"  # the block recipe: high-precision dispatch, no tensor-parallel plan
from lightning_moe_overlap.moe.adapters import find_experts
from lightning_moe_overlap.moe.capacity import capacity_problems
from lightning_moe_overlap.moe.dispatch.base import splits_evenly
from lightning_moe_overlap.parallel.dims import ParallelDims, ParallelDimsError
from lightning_moe_overlap.parallel.mesh import mesh_layout
from lightning_moe_overlap._checks import SAME_ON_EVERY_RANK, same_on_every_rank  # noqa: F401 - re-exported

OWNER = "`MoEOverlapStrategy`"



@dataclass(frozen=True)
class Problem:
    """One finding. ``error`` is the exception type to raise, or None for a warning."""

    rule: str
    message: str
    error: type[Exception] | None = ValueError

    @property
    def is_error(self) -> bool:
        return self.error is not None

    def __str__(self) -> str:
        kind = self.error.__name__ if self.error else "warning"
        return f"[{self.rule}] {kind}: {self.message}"


def _warn(rule: str, message: str) -> Problem:
    return Problem(rule, message, None)


# -- rules on the configuration alone --------------------------------------------------------------------------
def _failing(*checks: tuple[str, bool, str]) -> list[Problem]:
    """One problem for each ``(rule, ok, message)`` that is not ``ok``."""
    return [Problem(rule, f"{OWNER}: {message}") for rule, ok, message in checks if not ok]


def _when(broken: bool, rule: str, message: str, error: type[Exception] | None = ValueError) -> list[Problem]:
    """``[the problem]`` when the rule is ``broken`` (a warning with ``error=None``), else ``[]``."""
    return [Problem(rule, f"{OWNER}: {message}", error)] if broken else []


def rule_sizes(cfg: OverlapConfig) -> list[Problem]:
    sizes = {"ep": cfg.ep, "tp": cfg.tp, "pp": cfg.pp, "cp": cfg.cp}
    vpp_ok = cfg.vpp is None or is_positive_int(cfg.vpp)
    return _failing(
        *(("sizes", is_positive_int(v), f"`{n}={v!r}` must be a positive integer.") for n, v in sizes.items()),
        ("sizes", vpp_ok, f"`vpp={cfg.vpp!r}` must be None or a positive integer."),
        (
            "num-microbatches",
            is_positive_int(cfg.num_microbatches),
            f"`num_microbatches={cfg.num_microbatches!r}` must be a positive integer; each batch the dataloader "
            "yields is split into that many micro-batches.",
        ),
    )


def rule_choices(cfg: OverlapConfig) -> list[Problem]:
    choices = (
        ("dispatcher", cfg.dispatcher, DISPATCHERS),
        ("start_method", cfg.start_method, START_METHODS),
        ("expert_backend", cfg.expert_backend, EXPERT_BACKENDS),
        ("shard", cfg.shard, SHARD_MODES),
    )
    sms = cfg.deepep_num_sms
    return _failing(
        *(("choices", v in ok, f"`{n}={v!r}` is not one of {list(ok)}. Pick one of them.") for n, v, ok in choices),
        (
            "choices",
            cfg.pipeline_schedule is None or cfg.pipeline_schedule in PIPELINE_SCHEDULES,
            f"`pipeline_schedule={cfg.pipeline_schedule!r}` is not one of {list(PIPELINE_SCHEDULES)}; None picks "
            "`1f1b` at vpp=1 and `interleaved_1f1b` with virtual stages.",
        ),
        (
            "choices",
            cfg.flex_backend is None or cfg.flex_backend in FLEX_BACKENDS,
            f"`flex_backend={cfg.flex_backend!r}` is not one of {list(FLEX_BACKENDS)}.",
        ),
        (
            "deepep-num-sms",
            is_positive_int(sms) and sms % 2 == 0,
            f"`deepep_num_sms={sms!r}` must be a positive even integer (DeepEP splits its SMs into send/receive "
            "pairs). Try 20, DeepSeek-V3's setting.",
        ),
    )


def rule_capacity(cfg: OverlapConfig) -> list[Problem]:
    """``capacity_factor`` and ``token_drop_policy``: the rules of ``moe/capacity.py``, which every layer checks too."""
    rules = {"capacity_factor": "capacity-factor", "token_drop_policy": "choices"}
    found = capacity_problems(cfg.capacity_factor, cfg.token_drop_policy)
    return [Problem(rules[name], f"{OWNER}: {message}") for name, message in found.items()]


def rule_flex_backend_without_flex(cfg: OverlapConfig) -> list[Problem]:
    """Megatron-Bridge pitfall: the backend flag alone does not activate the flex dispatcher."""
    return _when(
        cfg.flex_backend is not None and cfg.dispatcher != "flex",
        "flex-backend-without-flex",
        f"`flex_backend={cfg.flex_backend!r}` does nothing with `dispatcher={cfg.dispatcher!r}`; the backend is only "
        "used by the flex dispatcher. Set `dispatcher='flex'` too, or drop `flex_backend`.",
    )


def _a_type(value: object) -> str:
    """``"a str"``, ``"an int"``: the type of ``value`` with its article, for messages."""
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def rule_dedup_without_alltoall(cfg: OverlapConfig) -> list[Problem]:
    """Deduplication is a setting of the alltoall dispatcher; flex (DeepEP) deduplicates by itself."""
    if not isinstance(cfg.alltoall_dedup, bool):
        return _when(
            True,
            "alltoall-dedup",
            f"`alltoall_dedup={cfg.alltoall_dedup!r}` is {_a_type(cfg.alltoall_dedup)}; it switches the "
            "alltoall dispatcher's deduplicated dispatch on or off. Pass True or False (default).",
            error=TypeError,
        )
    return _when(
        cfg.alltoall_dedup and cfg.dispatcher != "alltoall",
        "dedup-without-alltoall",
        f"`alltoall_dedup=True` does nothing with `dispatcher={cfg.dispatcher!r}`: only the alltoall dispatcher has a "
        "deduplicated path (flex/DeepEP always deduplicates, allgather sends every token). Drop `alltoall_dedup`, or "
        "use `dispatcher='alltoall'`.",
        error=None,
    )


def rule_alltoall_static(cfg: OverlapConfig) -> list[Problem]:
    """The static all-to-all layout (docs/dispatchers.md, "Static dispatch"): alltoall only, one row per (token,
    expert), experts on torch's grouped GEMM in high precision."""
    if not isinstance(cfg.alltoall_static, bool):
        return _when(
            True,
            "alltoall-static",
            f"`alltoall_static={cfg.alltoall_static!r}` is {_a_type(cfg.alltoall_static)}; it switches the "
            "alltoall dispatcher's static layout (no host read per layer) on or off. Pass True or False (default).",
            error=TypeError,
        )
    if not cfg.alltoall_static:
        return []
    clashes = [
        (cfg.dispatcher != "alltoall", f"dispatcher={cfg.dispatcher!r}", "dispatcher='alltoall'"),
        (cfg.alltoall_dedup, "alltoall_dedup=True (a row per token and rank, sized on the host)",
         "alltoall_dedup=False"),
        (cfg.expert_backend != "torch", f"expert_backend={cfg.expert_backend!r} (its GEMMs take host splits)",
         "expert_backend='torch'"),
        (cfg.fp8 is not None, f"fp8={cfg.fp8!r} (FP8 rows are scaled in host-sized blocks)", "fp8=None"),
    ]  # fmt: skip
    return [
        Problem(
            "alltoall-static",
            f"`alltoall_static=True` with {what}: the static layout sends fixed slots of high-precision rows through "
            f"the alltoall dispatcher to torch's grouped GEMM, which reads its counts on the device. Use {fix}, or "
            "alltoall_static=False.",
        )
        for clash, what, fix in clashes
        if clash
    ]


def rule_compile(cfg: OverlapConfig) -> list[Problem]:
    """``compile`` switches ``torch.compile`` of the dense regions on or off (docs/compile.md)."""
    return _when(
        not isinstance(cfg.compile, bool),
        "compile",
        f"`compile={cfg.compile!r}` is {_a_type(cfg.compile)}; it switches torch.compile of every MoE block's "
        "dense parts on or off. Pass True or False (default).",
        error=TypeError,
    )


def rule_shared_expert_overlap(cfg: OverlapConfig) -> list[Problem]:
    """Megatron-Bridge pitfall: shared-expert overlap and dispatch overlap both claim the dispatch window."""
    return _when(
        cfg.shared_expert_overlap and cfg.overlap,
        "shared-expert-overlap",
        "`shared_expert_overlap=True` conflicts with `overlap=True`"
        + ("" if cfg.overlap_requested else f" (on by default with num_microbatches={cfg.num_microbatches})")
        + ": the dispatch overlap already hides each all-to-all behind the other micro-batch's compute. Set "
        "`shared_expert_overlap=False` (or `overlap=False` to hide the dispatch behind the shared experts only).",
    )


def rule_pipeline(cfg: OverlapConfig) -> list[Problem]:
    """The pipeline settings: the layout string parses, and the schedule runs at these sizes (docs/pipeline.md)."""
    if rule_sizes(cfg) or rule_choices(cfg):
        return []  # reported there
    if cfg.pp == 1:
        ignored = [f"`{n}={v!r}`" for n, v in (("vpp", cfg.vpp), ("pipeline_schedule", cfg.pipeline_schedule),
                   ("pipeline_layout", cfg.pipeline_layout)) if v is not None and v != 1]  # fmt: skip
        return _when(
            bool(ignored),
            "pipeline-without-pp",
            f"{', '.join(ignored)} with `pp=1`: there is no pipeline, so the setting is ignored. Set `pp>1` to "
            "split the model into pipeline stages, or remove it.",
            error=None,
        )
    layout, parsed = _layout_problems(cfg)
    return layout + (_schedule_problems(cfg) if parsed else [])


def _layout_problems(cfg: OverlapConfig) -> tuple[list[Problem], bool]:
    """The problems of ``pipeline_layout`` (it parses, and has one chunk per virtual stage), and whether it parses
    (the schedule's rules need its chunk count)."""
    if cfg.pipeline_layout is None:
        return [], True
    from lightning_moe_overlap.config.pipeline_layout import parse_layout

    try:
        chunks = len(parse_layout(cfg.pipeline_layout))
    except (TypeError, ValueError) as err:
        return [Problem("pipeline-layout", f"{OWNER}: {err}", type(err))], False
    expected = cfg.pp * cfg.vpp if cfg.vpp is not None else None
    if chunks % cfg.pp or (expected is not None and chunks != expected):
        rule = f"pp * vpp = {expected}" if expected is not None else f"a multiple of pp={cfg.pp}"
        return [
            Problem(
                "pipeline-layout",
                f"{OWNER}: `pipeline_layout={cfg.pipeline_layout!r}` has {chunks} chunks; it needs {rule} "
                "(one per virtual stage). Add or remove '|' separators, or change `vpp`.",
            )
        ], True
    return [], True


def _schedule_problems(cfg: OverlapConfig) -> list[Problem]:
    """Every rule of the schedule in effect that these sizes break (``pipeline/schedules.py``), all at once."""
    from lightning_moe_overlap.pipeline.schedules import schedule_problems

    found = schedule_problems(
        cfg.resolved_schedule, pp=cfg.pp, vpp=cfg.resolved_vpp, num_microbatches=cfg.num_microbatches,
        overlap=bool(cfg.overlap),
    )  # fmt: skip
    return [Problem("pipeline-schedule", f"{OWNER}: {err}", type(err)) for err in found]


def rule_overlap_needs_microbatches(cfg: OverlapConfig) -> list[Problem]:
    return _when(
        cfg.overlap and cfg.num_microbatches == 1,
        "overlap-one-microbatch",
        "`overlap=True` with `num_microbatches=1`: there is no second micro-batch to overlap with, so each step runs "
        "sequentially. Set `num_microbatches>=2` to hide the all-to-all.",
        error=None,
    )


def rule_tensor_parallel(cfg: OverlapConfig) -> list[Problem]:
    """What tensor parallelism (``tp > 1``) needs and does not run with (docs/tensor_parallel.md)."""
    if not (is_positive_int(cfg.tp) and cfg.tp > 1):
        return []
    return [
        *_when(
            not cfg.sequence_parallel,
            "tp-sequence-parallel",
            f"`tp={cfg.tp}` with `sequence_parallel=False`: the MoE blocks would see the same tokens on every tp rank "
            "and route them tp times (Megatron refuses the same: MoE with tensor parallelism needs sequence "
            "parallelism). Set `sequence_parallel=True` (the default), or `tp=1`.",
        ),
    ]


def rule_shard(cfg: OverlapConfig) -> list[Problem]:
    """What sharding with FSDP2 (``shard="optimizer"`` / ``"full"``) does not run with in this version."""
    if cfg.shard not in ("optimizer", "full"):
        return []
    fix = "Set `shard='none'` (replicated parameters), or drop the other setting."
    return [
        *_when(
            cfg.expert_backend == "te",
            "shard-te",
            f"`shard={cfg.shard!r}` with `expert_backend='te'`: Transformer Engine's GroupedLinear holds views of the "
            "experts' parameters taken when the experts were built, and FSDP replaces those parameters by sharded "
            f"and gathered ones, so the views would compute on stale storage. {fix}",
            NotImplementedError,
        ),
    ]


def rule_overlap_grad_reduce(cfg: OverlapConfig) -> list[Problem]:
    """``overlap_grad_reduce`` / ``overlap_param_gather``: what they overlap exists only in the sharded modes."""
    sharded = cfg.shard in ("optimizer", "full")
    flags = (("overlap_grad_reduce", cfg.overlap_grad_reduce), ("overlap_param_gather", cfg.overlap_param_gather))
    return [
        *(
            problem
            for name, value in flags
            for problem in _when(
                not isinstance(value, bool), "overlap-flags", f"`{name}={value!r}` must be a bool (True or False).",
                TypeError,
            )
        ),
        *_when(
            cfg.overlap_grad_reduce is True and not sharded,
            "overlap-grad-reduce-unsharded",
            f"`overlap_grad_reduce=True` with `shard={cfg.shard!r}` has no effect: the early reduction is that of the "
            "FSDP units of the sharded modes (reduce-scatters issued during the last backward). Set "
            "`shard='optimizer'` or `shard='full'`, or drop `overlap_grad_reduce`.",
            None,
        ),
        *_when(
            cfg.overlap_param_gather is True,
            "overlap-param-gather-no-op",
            f"`overlap_param_gather=True` with `shard={cfg.shard!r}` has no effect: "
            + (
                "the parameters are gathered once per step, before the first micro-batch (the forward and backward "
                "of two micro-batches share the modules on two threads, so no unit may gather or reshard inside "
                "the step), so there is no later all-gather to prefetch under compute. Drop `overlap_param_gather`."
                if sharded
                else "nothing is gathered without a sharded mode. Drop `overlap_param_gather`."
            ),
            None,
        ),
    ]


def rule_torch_version(cfg: OverlapConfig, version: str | None = None) -> list[Problem]:
    """Megatron-core and Bridge record all-to-all overlap hangs below torch 2.6."""
    version = version or torch.__version__
    major, minor = (int(p) for p in version.split("+")[0].split(".")[:2])
    if cfg.overlap and (major, minor) < (2, 6):
        return [
            Problem(
                "torch-version",
                f"{OWNER}: `overlap=True` needs torch>=2.6 (found {version}); all-to-all overlap hangs below it. "
                "Upgrade torch.",
                RuntimeError,
            )
        ]
    return []


def rule_async_save(cfg: OverlapConfig) -> list[Problem]:
    """``async_save``: a bool; the background applies to the sharded format (a consolidated save gathers first)."""
    return [
        *_when(not isinstance(cfg.async_save, bool), "async-save",
               f"`async_save={cfg.async_save!r}` must be a bool (True or False).", TypeError),  # fmt: skip
        *_when(
            cfg.async_save is True and cfg.checkpoint_format == "consolidated",
            "async-save-consolidated",
            "`async_save=True` with `checkpoint_format='consolidated'`: a consolidated save gathers the whole model "
            "on rank 0 and writes it before returning; only sharded saves are written in the background. Use "
            "`checkpoint_format='sharded'` (the default) for background saves, and export a consolidated file once at "
            "the end.",
            None,
        ),
    ]


CONFIG_RULES: tuple[Callable[[OverlapConfig], list[Problem]], ...] = (
    rule_sizes,
    rule_choices,
    rule_capacity,
    rule_flex_backend_without_flex,
    rule_dedup_without_alltoall,
    rule_alltoall_static,
    rule_compile,
    rule_shared_expert_overlap,
    rule_pipeline,
    rule_overlap_needs_microbatches,
    rule_tensor_parallel,
    rule_shard,
    rule_overlap_grad_reduce,
    rule_async_save,
    rule_torch_version,
)


def check_config(cfg: OverlapConfig) -> list[Problem]:
    """Rules that need only the configuration (FP8 and the optimizer offload's settings included)."""
    problems = [p for rule in CONFIG_RULES for p in rule(cfg)]
    return problems + check_fp8(cfg.fp8, cfg) + check_offload_settings(cfg.optimizer_cpu_offload,
                                                                       cfg.optimizer_offload_fraction)


# -- optimizer CPU offload (optim/host_offload.py) ---------------------------------------------------------------
def check_offload_settings(enabled: bool, fraction: object) -> list[Problem]:
    """``optimizer_cpu_offload`` and ``optimizer_offload_fraction`` (checked by the strategy's constructor)."""
    number = isinstance(fraction, (int, float)) and not isinstance(fraction, bool)
    valid = number and 0 < fraction <= 1  # type: ignore[operator]
    return [
        *_when(
            not valid,
            "offload-fraction",
            f"`optimizer_offload_fraction={fraction!r}` must be a number in (0, 1]: the share of the parameters' "
            "elements (the largest parameters first) whose optimizer state and update live in host memory. Use 1.0 "
            "for all of them, or e.g. 0.5 for about half.",
        ),
        *_when(
            valid and fraction != 1 and not enabled,
            "offload-fraction-unused",
            f"`optimizer_offload_fraction={fraction!r}` does nothing without `optimizer_cpu_offload=True`. Set "
            "`optimizer_cpu_offload=True`, or leave the fraction at 1.0.",
            None,
        ),
    ]


# Optimizers whose update of one parameter reads more than that parameter's gradient and state: a step over two
# subsets of the parameters (the device's, then the host's) is not their step over all (class name: why).
_NOT_PER_PARAMETER = {
    "LBFGS": "its `step` re-evaluates the closure and treats every parameter as one flat vector",
    "ZeroRedundancyOptimizer": "it shards the state over the ranks itself and broadcasts the updated parameters",
    "SparseAdam": "it takes sparse gradients, and the host copies hold dense ones",
    "OffloadedOptimizer": "it is offloaded already",
}


def check_offload_optimizer(optimizer: object) -> list[Problem]:
    """The optimizer ``optimizer_cpu_offload=True`` wraps (after ``configure_optimizers``): a torch ``Optimizer``
    whose update of each parameter reads only that parameter, its gradient, its state and its group."""
    name = type(optimizer).__qualname__
    fix = (
        "The offload runs the optimizer's own `step` over the parameters kept on the device, then over the host "
        "copies of the others, which is one step over all of them only for an optimizer that updates each parameter "
        "from its own gradient and state (torch's Adam, AdamW, SGD, Adagrad, RMSprop, ...). Return such an optimizer "
        "from `configure_optimizers`, or set `optimizer_cpu_offload=False`."
    )
    if not isinstance(optimizer, torch.optim.Optimizer):
        return [Problem("offload-optimizer", f"{OWNER}: `optimizer_cpu_offload=True` needs a `torch.optim.Optimizer`; "
                        f"`configure_optimizers` returned a `{name}`. {fix}", TypeError)]  # fmt: skip
    why = next((_NOT_PER_PARAMETER[c.__name__] for c in type(optimizer).__mro__ if c.__name__ in _NOT_PER_PARAMETER),
               None)  # fmt: skip
    device_bound = _device_bound_groups(optimizer)
    return [
        *_when(why is not None, "offload-optimizer", f"`optimizer_cpu_offload=True` cannot wrap `{name}`: {why}. "
               f"{fix}", TypeError),  # fmt: skip
        *_when(
            bool(device_bound), "offload-optimizer-device-state",
            f"`optimizer_cpu_offload=True` cannot wrap `{name}` with {', '.join(device_bound)}: torch's update then "
            "asserts that every parameter and step counter is on the accelerator (CUDA graph capture), and the "
            "offloaded part runs on the host. Use `capturable=False` and a float learning rate (the defaults), or set "
            "`optimizer_cpu_offload=False`.",
            TypeError,
        ),
    ]


def _device_bound_groups(optimizer: torch.optim.Optimizer) -> list[str]:
    """What of ``optimizer``'s groups binds its update to the accelerator: ``capturable=True``, a tensor ``lr``."""
    found = []
    for i, group in enumerate(optimizer.param_groups):
        if group.get("capturable"):
            found.append(f"`capturable=True` (group {i})")
        if isinstance(group.get("lr"), torch.Tensor) and group["lr"].device.type != "cpu":
            found.append(f"a `{group['lr'].device.type}` tensor learning rate (group {i})")
    return found


# -- rules on the world ----------------------------------------------------------------------------------------
def check_world(cfg: OverlapConfig, world_size: int, ep_choices: list[int] | None = None) -> list[Problem]:
    """Rules that need the number of processes (before any is spawned). ``ep_choices``: the ep values that pass
    every rule on ep for the model (``ep_choices.passing_ep_values``), where it is known; the ep message suggests
    those instead of every divisor of dp*cp*tp."""
    if rule_sizes(cfg):
        return []  # the sizes themselves are wrong; reported by check_config
    try:
        dims = build_dims(cfg, world_size)  # the one implementation of the layout rules
    except ParallelDimsError as err:
        if err.rule == "ep-divides-dp-cp" and ep_choices is not None:
            return [Problem(err.rule, f"{OWNER}: {_ep_world_message(cfg, world_size, ep_choices)}")]
        return [Problem(err.rule, f"{OWNER}: {err.detail}")]
    try:
        mesh_layout(dims)
    except NotImplementedError as err:
        return [Problem("mesh-layout", f"{OWNER}: {err}", NotImplementedError)]
    if cfg.overlap_requested and cfg.ep == 1 and world_size > 1:  # only when asked: the default just resolves
        return [
            _warn(
                "overlap-ep1",
                f"{OWNER}: `overlap=True` with `ep=1`: no all-to-all crosses processes, so there is nothing to hide. "
                "Set `ep>1` for expert parallelism where the world allows it (the `ep-divides-dp-cp` rule), or leave "
                "`overlap` unset.",
            )
        ]
    return []


EP_CHOICES_RULES = "the values that pass every rule on ep: they divide every MoE block's experts"


def _ep_world_message(cfg: OverlapConfig, world_size: int, ep_choices: list[int]) -> str:
    span = world_size // cfg.pp
    flex = ", and fit DeepEP's group sizes" if cfg.resolved_flex_backend == "deepep" else ""
    return (
        f"ep={cfg.ep} does not divide dp*cp*tp={span} (world_size={world_size}, pp={cfg.pp}, cp={cfg.cp}, "
        f"tp={cfg.tp}); expert parallelism folds into the data-, context- and tensor-parallel ranks of a pipeline "
        f"stage, so ep must divide dp*cp*tp. Valid ep values here: {ep_choices} ({EP_CHOICES_RULES} and "
        f"dp*cp*tp{flex})"
        + ("." if ep_choices else "; none does: change the number of processes or the dispatcher.")
    )


def build_dims(cfg: OverlapConfig, world_size: int) -> ParallelDims:
    return ParallelDims.from_world_size(world_size, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, ep=cfg.ep, vpp=cfg.vpp)


# -- rules on the machine --------------------------------------------------------------------------------------
def check_machine(cfg: OverlapConfig, device_type: str, cuda_available: bool | None = None) -> list[Problem]:
    """Rules that need the accelerator and the installed packages."""
    cuda_available = torch.cuda.is_available() if cuda_available is None else cuda_available
    out: list[Problem] = []
    if cfg.resolved_flex_backend == "deepep":
        missing = []
        if importlib.util.find_spec("deep_ep") is None:
            missing.append("the `deep_ep` package")
        if not cuda_available or device_type != "cuda":
            missing.append("a CUDA device (Hopper with NVLink/RDMA)")
        if missing:
            out.append(
                Problem(
                    "flex-needs-deepep",
                    f"{OWNER}: `dispatcher='flex'` (backend 'deepep') needs {' and '.join(missing)}. Install it "
                    f"with {install_hint('deepep')} on a CUDA machine, or use "
                    "`dispatcher='alltoall'` (plain all-to-all, runs everywhere).",
                    ImportError,
                )
            )
    if cfg.expert_backend == "te":
        missing = []
        if importlib.util.find_spec("transformer_engine") is None:
            missing.append("the `transformer_engine` package")
        if not cuda_available or device_type != "cuda":
            missing.append(f"a CUDA device (the accelerator is {device_type!r})")
        if missing:
            out.append(
                Problem(
                    "te-needs-transformer-engine",
                    f"{OWNER}: `expert_backend='te'` runs the experts on Transformer Engine's GroupedLinear, which "
                    f"needs {' and '.join(missing)}. Install it with {install_hint('te')} "
                    "on a CUDA machine, or use `expert_backend='torch'` (pure PyTorch grouped GEMMs, runs everywhere).",
                    ImportError,
                )
            )
    if device_type == "cuda" and not cuda_available:
        out.append(
            Problem(
                "cuda-unavailable",
                f"{OWNER}: the accelerator is 'gpu' but this machine has no CUDA device "
                "(`torch.cuda.is_available()` is False). Run on a GPU machine, use `accelerator: cpu`, or check a "
                "GPU job's config from here with `--no-machine-checks`.",
                RuntimeError,
            )
        )
    if cfg.process_group_backend == "nccl" and device_type != "cuda":
        out.append(
            Problem(
                "backend-device",
                f"{OWNER}: `process_group_backend='nccl'` needs CUDA devices, but the accelerator is "
                f"{device_type!r}. Use 'gloo' on CPU, or leave it None to pick the default for the device.",
            )
        )
    return out + rule_overlap_pp_max_connections(cfg, device_type)


def rule_overlap_pp_max_connections(cfg: OverlapConfig, device_type: str) -> list[Problem]:
    """With one CUDA hardware queue, the pipeline's and the experts' communicators' kernels run in issue order,
    which the overlap at ``pp > 1`` does not keep the same across ranks: refuse it (a hang, not a slowdown)."""
    value = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "").strip()
    return _when(
        device_type == "cuda" and bool(cfg.overlap) and cfg.pp > 1 and value == "1",
        "overlap-pp-max-connections",
        f"overlap=True at pp={cfg.pp} with CUDA_DEVICE_MAX_CONNECTIONS=1: one hardware queue runs the kernels of the "
        "pipeline's and the experts' NCCL communicators in the order each rank issues them, and the overlap can "
        "issue them in different orders on different ranks, so the collectives wait on each other until the "
        "process-group timeout. Set CUDA_DEVICE_MAX_CONNECTIONS=32 (or unset it) before CUDA starts, or use "
        "overlap=False at pp > 1.",
        NotImplementedError,
    )


# -- rules on DeepEP (dispatcher="flex") ----------------------------------------------------------------------
DEEPEP_INTRANODE_EP: tuple[int, ...] = (2, 4, 8)  # ranks DeepEP's intranode kernels are compiled for
DEEPEP_GPUS_PER_NODE = 8  # NVLink peers per node DeepEP's internode (RDMA) kernels assume
# the ranks DeepEP's `Buffer.get_dispatch_config` / `get_combine_config` have a tuned config for (any other size
# fails there, at the first dispatch)
DEEPEP_CONFIGURED_EP: tuple[int, ...] = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160)
_PRECISION_ALIASES = {"16": "16-mixed", "bf16": "bf16-mixed", "32": "32-true", "64": "64-true", "half": "16-true"}


def normalize_precision(precision: object) -> str:
    """Lightning's precision name for ``precision`` (``16`` -> ``"16-mixed"``, ``"bf16"`` -> ``"bf16-mixed"``)."""
    name = str(precision)
    return _PRECISION_ALIASES.get(name, name)


def rule_flex_ep_size(cfg: OverlapConfig, devices_per_node: int | None) -> list[Problem]:
    """DeepEP runs on 2, 4 or 8 ranks of one node, or across nodes of 8 GPUs on the sizes its dispatch and combine
    have a config for (16, 24, 32, 48, 64, 96, 128, 144, 160)."""
    if cfg.resolved_flex_backend != "deepep" or not is_positive_int(cfg.ep):
        return []
    ep = cfg.ep
    per_node = f"devices per node={devices_per_node}" if devices_per_node else "devices per node unknown"
    if devices_per_node is None:
        in_one_node = ep <= DEEPEP_GPUS_PER_NODE
    else:
        in_one_node = ep <= devices_per_node and devices_per_node % ep == 0
    if in_one_node and ep not in DEEPEP_INTRANODE_EP:
        hint = " (ep=1 moves no token between processes)" if ep == 1 else ""
        return [
            Problem(
                "flex-ep-size",
                f"{OWNER}: `dispatcher='flex'` with `ep={ep}` ({per_node}){hint}: DeepEP's intranode kernels run on "
                f"{list(DEEPEP_INTRANODE_EP)} ranks of one node, and across nodes on a multiple of "
                f"{DEEPEP_GPUS_PER_NODE}. Set `ep` to one of {list(DEEPEP_INTRANODE_EP)} (or a multiple of "
                f"{DEEPEP_GPUS_PER_NODE} across nodes), or use `dispatcher='alltoall'`.",
            )
        ]
    internode = [n for n in DEEPEP_CONFIGURED_EP if n > DEEPEP_GPUS_PER_NODE]
    if not in_one_node and (ep not in internode or devices_per_node not in (None, DEEPEP_GPUS_PER_NODE)):
        return [
            Problem(
                "flex-ep-size",
                f"{OWNER}: `dispatcher='flex'` with `ep={ep}` ({per_node}) spans nodes: DeepEP's internode "
                f"(RDMA) kernels need {DEEPEP_GPUS_PER_NODE} GPUs per node, and its dispatch and combine have a "
                f"config for ep in {internode} only. Use ep in {list(DEEPEP_INTRANODE_EP)} inside a node or one of "
                f"{internode} on nodes of {DEEPEP_GPUS_PER_NODE} GPUs, or `dispatcher='alltoall'`.",
            )
        ]
    return []


def rule_flex_precision(cfg: OverlapConfig, precision: object) -> list[Problem]:
    """DeepEP moves bfloat16 activations only: the dispatcher casts to it, which is lossless only from bf16."""
    if cfg.resolved_flex_backend != "deepep" or precision is None:
        return []
    name = normalize_precision(precision)
    if name in ("16-mixed", "16-true", "transformer-engine-float16"):
        return [
            Problem(
                "flex-precision",
                f"{OWNER}: `dispatcher='flex'` with `precision={name!r}`: DeepEP's kernels move bfloat16 only, and "
                "float16 activations and loss-scaled gradients would be rounded to bfloat16 (3 mantissa bits "
                "fewer) on every exchange. Use `precision='bf16-mixed'`, or `dispatcher='alltoall'` for float16.",
                NotImplementedError,
            )
        ]
    if name in ("32-true", "64-true"):
        return [
            _warn(
                "flex-precision",
                f"{OWNER}: `dispatcher='flex'` with `precision={name!r}`: DeepEP's kernels move bfloat16 only, so "
                "tokens and expert outputs are rounded to bfloat16 on every exchange (and cast back). Use "
                "`precision='bf16-mixed'`, or `dispatcher='alltoall'` to keep full precision on the wire.",
            )
        ]
    return []


def check_flex(cfg: OverlapConfig, *, devices_per_node: int | None = None, precision: object = None) -> list[Problem]:
    """DeepEP's prerequisites (``dispatcher="flex"``): group sizes it has kernels for, and its dtype."""
    return rule_flex_ep_size(cfg, devices_per_node) + rule_flex_precision(cfg, precision)


# -- rules on the model ----------------------------------------------------------------------------------------
def valid_ep_values(experts_per_block: Mapping[str, int], ep_span: int | None) -> list[int]:
    """The ep values that satisfy every rule at once: divide every block's experts and, if known, dp*cp*tp (the
    ranks ep folds into)."""
    common = math.gcd(*experts_per_block.values(), *([ep_span] if ep_span else []))
    return divisors(common)


def check_model(
    cfg: OverlapConfig,
    experts_per_block: Mapping[str, int],
    ep_span: int | None = None,
    ep_choices: list[int] | None = None,
) -> list[Problem]:
    """Rules that need the model: ``experts_per_block`` maps each MoE block's name to its number of experts;
    ``ep_span`` (when the world size is known) narrows the suggested ep values to those valid for it too;
    ``ep_choices`` (``ep_choices.passing_ep_values``), where given, are the values suggested: every rule on ep."""
    out: list[Problem] = []
    if not experts_per_block:
        if cfg.ep > 1:
            out.append(
                _warn(
                    "no-moe-blocks",
                    f"{OWNER}: `ep={cfg.ep}` but the model has no MoE block this package recognises, so nothing is "
                    "expert-parallel. Register your block type with `register_experts_adapter` (docs/adapters.md).",
                )
            )
        return out
    bad = {name: n for name, n in experts_per_block.items() if not splits_evenly(n, cfg.ep)}
    if bad:
        name, n = next(iter(bad.items()))
        if ep_choices is not None:
            flex = ", and fit DeepEP's group sizes" if cfg.resolved_flex_backend == "deepep" else ""
            why = f"{EP_CHOICES_RULES}{' and dp*cp*tp=' + str(ep_span) if ep_span else ''}{flex}"
        else:
            ep_choices = valid_ep_values(experts_per_block, ep_span)
            why = f"the values that divide every block's experts{' and dp*cp*tp=' + str(ep_span) if ep_span else ''}"
        out.append(
            Problem(
                "experts-divisible-by-ep",
                f"{OWNER}: `{name}` has num_experts={n}, which ep={cfg.ep} does not divide "
                f"({len(bad)} block(s) affected); each ep rank must own the same number of experts. "
                f"Choose ep among {ep_choices} ({why}).",
            )
        )
    return out


# -- rules on the trainer --------------------------------------------------------------------------------------
def check_trainer(cfg: OverlapConfig, *, automatic_optimization: bool) -> list[Problem]:
    out: list[Problem] = []
    if not automatic_optimization:
        out.append(
            Problem(
                "manual-optimization",
                f"{OWNER}: manual optimization (`automatic_optimization=False`) is not supported: the strategy runs "
                "the micro-batch schedule and backward itself. Use automatic optimization.",
                NotImplementedError,
            )
        )
    return out


# -- rules on the arguments of `fit` (before spawning) ------------------------------------------------------------
CKPT_ALIASES = ("last", "best", "hpc", "registry")


def known_batch_size(datamodule: Any) -> int | None:
    """The datamodule's batch size where it says it (a ``batch_size`` attribute or hyper-parameter), else None."""
    if datamodule is None:
        return None
    value = getattr(datamodule, "batch_size", None)
    if value is None:
        value = getattr(datamodule, "hparams", {}).get("batch_size")
    return value if is_positive_int(value) else None


def check_launch(cfg: OverlapConfig, batch_size: int | None = None, ckpt_path: Any = None) -> list[Problem]:
    """Rules on what ``fit`` was given, checked before any process starts: the batch size each dataloader yields
    (where known, e.g. from :func:`known_batch_size`) and the checkpoint to resume from."""
    out: list[Problem] = []
    if batch_size is not None and is_positive_int(cfg.num_microbatches) and batch_size % cfg.num_microbatches:
        fits = [m for m in divisors(batch_size) if m > 1] or [1]
        out.append(
            Problem(
                "batch-size-microbatches",
                f"{OWNER}: the datamodule's batch_size={batch_size} does not split into "
                f"`num_microbatches={cfg.num_microbatches}` equal micro-batches; the batch size must be a multiple "
                f"of num_microbatches. Use a batch size that is a multiple of {cfg.num_microbatches}, or pick "
                f"num_microbatches among {fits}.",
            )
        )
    if isinstance(ckpt_path, (str, os.PathLike)) and str(ckpt_path) not in CKPT_ALIASES:
        path = os.fspath(ckpt_path)
        if "://" not in path and not os.path.exists(path):
            out.append(
                Problem(
                    "ckpt-path-exists",
                    f"{OWNER}: `ckpt_path={path!r}` does not exist (resolved: {os.path.abspath(path)!r}); a run "
                    "resumes from an existing checkpoint file or sharded directory. Fix the path, or pass "
                    "`ckpt_path=None` to start fresh.",
                    FileNotFoundError,
                )
            )
    return out


def check_train_loaders(cfg: OverlapConfig, loaders: Any) -> list[Problem]:
    """:func:`check_loader` on each ``DataLoader`` in ``loaders`` (``trainer.train_dataloader``: one loader or a
    collection of them); a loader without a ``batch_size`` (its own batch sampler) or a length is not checked."""
    found: list[DataLoader] = []
    apply_to_collection(loaders, DataLoader, found.append)
    out: list[Problem] = []
    for loader in found:
        try:
            samples: int | None = len(loader.sampler)  # this rank's samples (a DistributedSampler's share)
        except TypeError:  # an iterable dataset: no length
            samples = None
        out += check_loader(cfg, loader.batch_size, samples, loader.drop_last)
    return out


def check_loader(
    cfg: OverlapConfig, batch_size: int | None, samples: int | None = None, drop_last: bool = False
) -> list[Problem]:
    """Rules on the training dataloader as the Trainer prepared it (at the start of training, before the first
    step): its ``batch_size``, and at ``pp > 1`` the epoch's last batch (``samples`` per rank, ``drop_last``).

    At ``pp = 1`` a short last batch runs as fewer or nearly equal micro-batches (``loop.py``); torch's pipeline
    schedules fix the micro-batches' shapes at the first step (their stages exchange buffers of those shapes), so
    at ``pp > 1`` any short last batch is refused here, not at the epoch's end."""
    m = cfg.num_microbatches
    if batch_size is None or not is_positive_int(m):
        return []
    if batch_size % m:
        fits = [d for d in divisors(batch_size) if d > 1] or [1]
        return [
            Problem(
                "batch-size-microbatches",
                f"{OWNER}: the training dataloader's batch_size={batch_size} does not split into "
                f"`num_microbatches={m}` equal micro-batches; the batch size must be a multiple of "
                f"num_microbatches. Use a batch size that is a multiple of {m}, or pick num_microbatches among "
                f"{fits}.",
            )
        ]
    last = samples % batch_size if samples is not None and not drop_last else 0
    if cfg.pp > 1 and last:
        return [
            Problem(
                "short-last-batch-pipeline",
                f"{OWNER}(pp={cfg.pp}): the epoch's last batch would hold {last} of batch_size={batch_size} rows "
                f"({samples} samples per data-parallel rank, drop_last=False). Rule `short-last-batch-pipeline`: "
                "at pp > 1 every batch is full, since torch's pipeline schedules fix the micro-batches' shapes at "
                "the first step. Set `drop_last=True` on the training DataLoader, or use a number of samples per "
                f"rank that is a multiple of {batch_size}.",
            )
        ]
    return []


# -- FP8 (`fp8=`; docs/fp8.md) --------------------------------------------------------------------------------------
def check_fp8(fp8: object, cfg: OverlapConfig) -> list[Problem]:
    """The ``fp8`` argument against the configuration: a recipe that runs here, and the combinations FP8 has."""
    if fp8 is None:
        return []
    if fp8 in NEEDS_TE:
        return [Problem(
            "fp8-needs-te",
            f"{OWNER}: `fp8={fp8!r}` ({NEEDS_TE[fp8]}) needs Transformer Engine's FP8 on a CUDA GPU, which this "
            f"package does not wire yet; the recipes that run, on CPU and CUDA, are {list(RECIPES)}. Use "
            "`fp8='rowwise'` (the closest in accuracy), `fp8='mxfp8'` or `fp8='tensorwise'`.",
            NotImplementedError,
        )]  # fmt: skip
    if not isinstance(fp8, str) or fp8 not in RECIPES:
        return [Problem(
            "fp8-recipe",
            f"{OWNER}: `fp8={fp8!r}` is not an FP8 recipe; the rule is one of {list(RECIPES)} or None (high "
            "precision). Pass `fp8='rowwise'` or `fp8='tensorwise'` (docs/fp8.md, \"Recipes\").",
        )]  # fmt: skip
    dispatch = "the rows are then dispatched in high precision; only `dispatcher='alltoall'` sends them in FP8"
    mx = fp8 == MXFP8
    return [
        *_when(cfg.expert_backend == "te", "fp8-te-experts",
               f"`fp8={fp8!r}` with `expert_backend='te'`: Transformer Engine's own FP8 recipes are not wired here "
               "yet, and the FP8 expert kernel runs on the torch backend. Use `expert_backend='torch'` with fp8, "
               "or fp8=None.", NotImplementedError),
        *_when(mx and cfg.tp > 1, "fp8-mxfp8-tp",
               f"`fp8='mxfp8'` with tp={cfg.tp}: torchao's MX linear is not wired with the tensor-parallel plan's "
               "styles yet. Use tp=1 with fp8='mxfp8', or fp8='rowwise' / 'tensorwise' at tp > 1.",
               NotImplementedError),
        *_when(mx, "fp8-dispatch-high-precision",
               "`fp8='mxfp8'`: the GEMMs run in MXFP8 but the rows are dispatched in high precision, with every "
               "dispatcher (the FP8 dispatch sends one scale per row; MXFP8 scales blocks of 32 and is not wired "
               "into it). Use fp8='rowwise' with `dispatcher='alltoall'` to send them in FP8.", None),
        *_when(not mx and cfg.dispatcher != "alltoall", "fp8-dispatch-high-precision",
               f"`fp8={fp8!r}` with `dispatcher={cfg.dispatcher!r}`: the GEMMs run in FP8 but {dispatch}.", None),
    ]  # fmt: skip


def check_fp8_machine(
    fp8: object, device_type: str, *, cuda_capability: tuple[int, int] | None = None, torchao: bool | None = None
) -> list[Problem]:
    """FP8 on this machine: torchao for the dense linears, FP8 tensor cores on a CUDA GPU."""
    if fp8 not in RECIPES:
        return []
    torchao = importlib.util.find_spec("torchao") is not None if torchao is None else torchao
    if device_type == "cuda" and cuda_capability is None and torch.cuda.is_available():
        cuda_capability = torch.cuda.get_device_capability()
    old_gpu = device_type == "cuda" and cuda_capability is not None and cuda_capability < MIN_CUDA_CAPABILITY
    return [
        *_when(not torchao, "fp8-needs-torchao",
               f"`fp8={fp8!r}` runs the dense linears through torchao's float8 training, which is not installed. "
               f"Install it with {install_hint('fp8')}.", ImportError),
        *_when(old_gpu, "fp8-gpu",
               f"`fp8={fp8!r}` on a GPU of compute capability {cuda_capability}: FP8 GEMMs need "
               f"{MIN_CUDA_CAPABILITY} or newer (Ada, Hopper, Blackwell). Train in bf16 (fp8=None) on this GPU, or "
               "on a newer one.", NotImplementedError),
    ]  # fmt: skip


def check_fp8_model(fp8: object, model: Any) -> list[Problem]:
    """One warning naming the layers that stay in high precision because a dim is not a multiple of 16 (32 with
    ``mxfp8``: the FP8 GEMMs' rule): dense linears the default filter would convert, and experts modules."""
    if fp8 not in RECIPES:
        return []
    align = linear_align(RECIPES[fp8])
    _, skipped = plan_linears(model, align=align)
    kept = [f"{fqn} ({why.split(':')[0]})" for fqn, why in skipped.items() if "multiples of" in why]
    for name, found in find_experts(model).items():
        dims = sorted({d for w in found.module.parameters(recurse=False) if w.dim() == 3 for d in w.shape[1:]})
        if any(d % align for d in dims):
            kept.append(f"{name} (expert weight dims {dims})")
    return _when(bool(kept), "fp8-dims",
                 f"`fp8={fp8!r}`: {len(kept)} layer(s) stay in high precision, a dim not a multiple of "
                 f"{align} (the FP8 GEMMs' rule): {', '.join(kept)}. Pad those dims to multiples of {align} "
                 "to run them in FP8; the rest of the model runs in FP8.", None)  # fmt: skip


# -- raising ---------------------------------------------------------------------------------------------------
def with_rule(problem: Problem) -> str:
    """The problem's message, ending with its rule id (the key of docs/validation.md) unless it names it already."""
    if f"`{problem.rule}`" in problem.message:
        return problem.message
    return f"{problem.message} (rule `{problem.rule}`, docs/validation.md)"


def raise_problems(problems: list[Problem]) -> None:
    """Emit warnings (once, on rank 0, each naming its rule); raise the first error's type with every error listed.

    The raised error carries ``same_on_every_rank=True``: the rules read only what every rank reads alike, so the
    launcher shows it once (rank 0) instead of once per rank."""
    for p in problems:
        if not p.is_error:
            rank_zero_warn(with_rule(p), category=UserWarning, stacklevel=5)
    errors = [p for p in problems if p.is_error]
    if not errors:
        return
    if len(errors) == 1:
        err = errors[0].error(errors[0].message)  # type: ignore[misc]
    else:
        text = "\n".join(f"  {i}. {p.message}" for i, p in enumerate(errors, 1))
        err = errors[0].error(f"{OWNER}: {len(errors)} problems:\n{text}")  # type: ignore[misc]
    raise same_on_every_rank(err)
