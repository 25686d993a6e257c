"""The ``--pp`` path of ``overlap.py``: the same blocks as pipeline chunks, one schedule with overlap on and off.

World ``ranks = pp x dp``, expert parallelism over the dp ranks (``ep`` divides ``dp``). The model's ``layers``
blocks are cut into ``pp * vpp`` chunks of ``layers / (pp * vpp)`` consecutive blocks; each rank holds the chunks
of ``stage_indices`` and runs torch's schedule (``build_stages`` + ``build_schedule``) through a
``PipelineExecutor``. Two modes, their steps interleaved in one run:

- ``sequential``: ``OverlapEngine(overlap=False)``: torch's schedule as it is;
- ``overlap``: ``overlap=True``: every ``OVERLAP_F_B`` action (interleaved 1F1B rewritten into pairs, DualPipeV's
  own, 1F1B's paired order) runs its forward and backward as the engine's two contexts.

With ``--compare-schedules`` the runs are those of :data:`COMPARED` instead (each schedule sequential and overlapped,
``--vpp`` ignored), their steps interleaved in one run, every ratio against ``1f1b/sequential``. ``--a2a-delay-ms``
makes each EP all-to-all last at least that long (:class:`DelayedCommunicator`), as a slower network would.

Per rank and step it records the step time, the time inside the schedule's ``step``, the time inside compute
actions (every ``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk`` of the rank's
stages, timed by a wrapper, overlapping intervals of a pair counted once) and the EP all-to-all waits
(``CommTimer``). The *measured bubble* is ``1 - compute / schedule`` per rank; the *schedule's bubble* counts the
idle slots of torch's ``pipeline_order``; the *stage concurrency* of a pipeline is how many of its pp ranks compute
at once, on average, while any of them does (1 when they take turns, ``pp`` when they always run together).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_moe_overlap.moe.ep import apply_expert_parallel
from lightning_moe_overlap.overlap.communicator import TORCH
from lightning_moe_overlap.overlap.engine import OverlapEngine
from lightning_moe_overlap.overlap.observers import CommTimer
from lightning_moe_overlap.overlap.runtime import CommRuntime
from lightning_moe_overlap.parallel import ParallelGroups
from lightning_moe_overlap.parallel.grads import sync_gradients
from lightning_moe_overlap.pipeline.executor import PipelineExecutor
from lightning_moe_overlap.pipeline.schedules import build_schedule, build_stages, render_order, stage_indices

SCHEDULES = ("1f1b", "interleaved_1f1b", "dualpipev")  # those that run a full backward (no split into I / W)
PP_MODES: dict[str, bool] = {"sequential": False, "overlap": True}  # name -> overlap
TIMED_ACTIONS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
Run = tuple[str, int, bool]  # (schedule, vpp, overlap)
COMPARED: dict[str, Run] = {
    "1f1b/sequential": ("1f1b", 1, False),
    "1f1b/overlap": ("1f1b", 1, True),
    "interleaved/sequential": ("interleaved_1f1b", 2, False),
    "interleaved/overlap": ("interleaved_1f1b", 2, True),
    "dualpipev/sequential": ("dualpipev", 2, False),
    "dualpipev/overlap": ("dualpipev", 2, True),
}


def pp_modes(cfg: Any) -> dict[str, Run]:
    """The runs a pipeline benchmark measures, by name; the first is the one every ratio divides by."""
    if cfg.compare_schedules:
        return dict(COMPARED)
    return {mode: (cfg.schedule_name, cfg.vpp, overlap) for mode, overlap in PP_MODES.items()}


class DelayedCommunicator:
    """torch's collectives, each all-to-all's wait returning no earlier than ``delay_s`` after its issue (a slower
    network's latency; the rank sleeps, leaving its core to the others)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def __getattr__(self, name: str) -> Any:
        return getattr(TORCH, name)

    def all_to_all(self, *args: Any, **kwargs: Any) -> Any:
        return _Delayed(TORCH.all_to_all(*args, **kwargs), time.perf_counter() + self.delay_s)


class _Delayed:
    def __init__(self, work: Any, until: float) -> None:
        self.work, self.until = work, until

    def wait(self) -> Any:
        out = self.work.wait()
        remaining = self.until - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        return out


class Chunk(nn.Module):
    """Consecutive blocks of the model (shared with it, not copied): one pipeline stage."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x_TD: Tensor) -> Tensor:
        for block in self.blocks:
            x_TD = block(x_TD)
        return x_TD


class ActionClock:
    """Wall-time intervals of a rank's compute actions; the two contexts of a pair record into the same clock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[tuple[float, float]] = []

    def attach(self, stage: Any) -> None:
        """Time the compute methods of a ``PipelineStage`` (instance attributes that shadow its public methods)."""
        for name in TIMED_ACTIONS:
            setattr(stage, name, self._timed(getattr(stage, name)))

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                end = time.perf_counter()
                with self._lock:
                    self._spans.append((start, end))

        return timed

    def reset(self) -> tuple[int, list[tuple[float, float]]]:
        """Clear; returns the actions since the last reset and the spans inside at least one of them, merged."""
        with self._lock:
            spans, self._spans = self._spans, []
        return len(spans), merge(spans)


def merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of intervals, as sorted disjoint intervals."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def length(spans: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in spans)


def concurrency(busy_per_rank: list[list[tuple[float, float]]]) -> float:
    """How many of a pipeline's ranks compute at once on average while any does: ``sum(busy) / |union(busy)|``;
    1 when they take turns, ``pp`` when they always compute together. Needs one clock for all ranks (one host:
    ``perf_counter`` is ``CLOCK_MONOTONIC`` on Linux)."""
    union = length(merge([span for spans in busy_per_rank for span in spans]))
    return sum(length(spans) for spans in busy_per_rank) / union if union else 0.0


@dataclass
class PipeTrainer:
    """One mode: the model (all blocks; the rank's chunks hold some), its schedule, executor and optimizer."""

    net: nn.Module
    schedule: Any
    executor: PipelineExecutor
    timer: CommTimer
    clock: ActionClock
    optimizer: torch.optim.Optimizer
    dense: list[nn.Parameter]
    expert: list[nn.Parameter]
    indices: list[int] = field(default_factory=list)
    num_stages: int = 1


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(output, target)


def build_pipe_trainer(cfg: Any, run: Run, groups: ParallelGroups, device: torch.device, net: nn.Module) -> PipeTrainer:
    """This rank's chunks of ``net`` (a stack of ``cfg.layers`` blocks) for ``run``, expert-parallel over
    ``groups.ep``."""
    name, vpp, overlap = run
    num_stages = cfg.pp * vpp
    per = cfg.layers // num_stages
    indices = stage_indices(name, pp=cfg.pp, vpp=vpp, pp_rank=groups.coords.pp)
    chunks = [Chunk(list(net.blocks[i * per : (i + 1) * per])) for i in indices]
    delay = getattr(cfg, "a2a_delay_ms", 0.0)
    runtime = CommRuntime(communicator=DelayedCommunicator(delay / 1e3)) if delay > 0 else CommRuntime()
    knobs = {"dedup": cfg.dedup} if cfg.dispatcher == "alltoall" else {}
    expert_ids = {
        id(p)
        for chunk in chunks
        for module in apply_expert_parallel(chunk, groups.ep, dispatcher=cfg.dispatcher, runtime=runtime, **knobs)
        for p in module.parameters()
    }
    timer = CommTimer()
    runtime.attach(timer)
    stages = build_stages(chunks, indices, num_stages, groups.pp, device)
    clock = ActionClock()
    for stage in stages:
        clock.attach(stage)
    schedule = build_schedule(name, stages, cfg.microbatches, loss_fn, overlap=overlap)
    engine = OverlapEngine(runtime, overlap=overlap, timeout_s=600)
    params = [p for chunk in chunks for p in chunk.parameters()]
    return PipeTrainer(
        net=net,
        schedule=schedule,
        executor=PipelineExecutor(schedule, engine),
        timer=timer,
        clock=clock,
        optimizer=torch.optim.SGD(params, lr=1e-3),
        dense=[p for p in params if id(p) not in expert_ids],
        expert=[p for p in params if id(p) in expert_ids],
        indices=indices,
        num_stages=num_stages,
    )


def pipe_step(t: PipeTrainer, cfg: Any, groups: ParallelGroups, batch: tuple[Tensor, Tensor]) -> dict[str, float]:
    """One optimizer step; returns its wall time, the schedule's, the compute actions' and the EP waits'."""
    x_ND, y_ND = batch  # N = microbatches * tokens; the schedule splits dim 0 into micro-batches
    num_stages = t.num_stages
    args = (x_ND,) if 0 in t.indices else ()
    target = y_ND if num_stages - 1 in t.indices else None
    t.timer.reset()
    t.clock.reset()
    cpu_start = time.process_time()
    start = time.perf_counter()
    t.optimizer.zero_grad(set_to_none=False)
    schedule_start = time.perf_counter()
    t.executor.step(*args, target=target, losses=[])
    schedule_s = time.perf_counter() - schedule_start
    actions, busy = t.clock.reset()
    busy_s = length(busy)
    dp_cp_size = dist.get_world_size(groups.dp_cp)
    sync_gradients(t.dense, t.expert, dp_cp_group=groups.dp_cp, edp_group=groups.edp, dp_cp_size=dp_cp_size)
    t.optimizer.step()
    end = time.perf_counter()
    comm = t.timer.snapshot()
    return {
        "step_s": end - start,
        "schedule_s": schedule_s,
        "busy_s": busy_s,
        "bubble": 1.0 - busy_s / schedule_s,
        "actions": actions,
        "busy_spans": busy,
        "blocked_s": comm.blocked_s,
        "waits": comm.waits,
        "cpu_s": time.process_time() - cpu_start,
    }


def slot_bubble(order: dict[int, list[Any]]) -> dict[int, tuple[int, int]]:
    """Per pp rank, (idle slots, slots) of a compute order: ``None`` entries plus the slots after the rank's last
    action until the longest rank's last; every action, a pair too, is one slot."""
    length = max(len(actions) for actions in order.values())
    return {rank: (sum(a is None for a in actions) + length - len(actions), length) for rank, actions in order.items()}


def rank_main(
    rank: int,
    cfg: Any,
    groups: ParallelGroups,
    device: torch.device,
    make_net: Callable[[], nn.Module],
    batch_MTD: tuple[Tensor, Tensor],
    align: Callable[[torch.device], None],
) -> dict[str, Any]:
    """Run both modes, steps interleaved; this rank's per-step records, the schedules' orders and bubble counts."""
    runs = pp_modes(cfg)
    modes = list(runs)
    trainers = {mode: build_pipe_trainer(cfg, runs[mode], groups, device, make_net()) for mode in modes}
    batch = tuple(t.flatten(0, 1) for t in batch_MTD)  # [M * T, D]
    records: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    for step in range(cfg.warmup + cfg.steps):
        for mode, trainer in trainers.items():
            align(device)
            record = pipe_step(trainer, cfg, groups, batch)
            if step >= cfg.warmup:
                records[mode].append(record)
    equal = True  # overlapped bitwise its schedule run sequentially
    for mode, trainer in trainers.items():
        plain = next(m for m in modes if runs[m][0] == runs[mode][0])
        pairs = zip(trainers[plain].net.parameters(), trainer.net.parameters(), strict=True)
        equal = equal and all(torch.equal(p, q) for p, q in pairs)
    # the action runtimes' orders (torch's single-stage ``Schedule1F1B`` does not run one: n/a)
    orders = {mode: t.schedule.pipeline_order if hasattr(t.schedule, "pipeline_order_with_comms") else None
              for mode, t in trainers.items()}  # fmt: skip
    return {
        "records": records,
        "bitwise_equal": equal,
        "coords": asdict(groups.coords),
        "indices": {mode: t.indices for mode, t in trainers.items()},
        "slots": {mode: slot_bubble(order) if order else None for mode, order in orders.items()},
        "orders": {mode: render_order(order) if order else None for mode, order in orders.items()},
    }


# -- summary -------------------------------------------------------------------------------------------------------
def summarise(results: list[dict[str, Any]], cfg: Any) -> dict[str, Any]:
    """Per mode: medians over steps of the slowest rank's step; the ratio; per rank the bubble and EP waits."""
    median = statistics.median
    runs = pp_modes(cfg)
    modes = list(runs)
    out: dict[str, Any] = {}
    for mode in modes:
        per_rank = [r["records"][mode] for r in results]
        steps_s = [max(records[i]["step_s"] for records in per_rank) for i in range(len(per_rank[0]))]
        out[mode] = {
            "step_s": median(steps_s),
            "steps_s": steps_s,
            "schedule_s": median(max(rs[i]["schedule_s"] for rs in per_rank) for i in range(len(steps_s))),
            "ranks": [rank_figures(r, mode) for r in results],
            "concurrency": pipeline_concurrency(results, mode),
        }
    base = out[modes[0]]["steps_s"]
    for mode, values in out.items():
        values["ratio"] = median(a / b for a, b in zip(values["steps_s"], base, strict=True))
        plain = out[next(m for m in modes if runs[m][0] == runs[mode][0])]  # its schedule, sequential
        exposed = statistics.fmean(r["blocked_s"] for r in values["ranks"])
        plain_exposed = statistics.fmean(r["blocked_s"] for r in plain["ranks"])
        values["exposed_s"] = exposed
        values["bubble_mean"] = statistics.fmean(r["bubble"] for r in values["ranks"])
        values["hidden"] = 1.0 - exposed / plain_exposed if plain_exposed else 0.0
        # every all-to-all hidden, nothing else changed: the schedule's sequential step less its exposed waits
        values["limit"] = (plain["step_s"] - plain_exposed) / out[modes[0]]["step_s"]
    return {
        "config": {**asdict(cfg), "schedule": "compared" if cfg.compare_schedules else cfg.schedule_name,
                   "dp": cfg.ranks // cfg.pp},
        "torch": torch.__version__,
        "bitwise_equal": all(r["bitwise_equal"] for r in results),
        "orders": results[0]["orders"],
        "modes": out,
    }


def pipeline_concurrency(results: list[dict[str, Any]], mode: str) -> list[float]:
    """Per pipeline (the pp ranks of one dp coordinate; index = dp rank), the median over steps of
    :func:`concurrency`."""
    pipelines: dict[int, list[dict[str, Any]]] = {}
    for r in results:
        pipelines.setdefault(r["coords"]["dp"], []).append(r)
    return [
        statistics.median(
            concurrency([r["records"][mode][i]["busy_spans"] for r in members])
            for i in range(len(members[0]["records"][mode]))
        )
        for _, members in sorted(pipelines.items())
    ]


def rank_figures(result: dict[str, Any], mode: str) -> dict[str, Any]:
    """One rank's medians over steps in ``mode``, and its schedule's bubble count."""
    median = statistics.median
    records = result["records"][mode]
    slots = result["slots"][mode]
    idle, total = slots[result["coords"]["pp"]] if slots else (None, None)
    return {
        "coords": result["coords"],
        "stages": result["indices"][mode],
        "step_s": median(r["step_s"] for r in records),
        "schedule_s": median(r["schedule_s"] for r in records),
        "busy_s": median(r["busy_s"] for r in records),
        "bubble": median(r["bubble"] for r in records),
        "blocked_s": median(r["blocked_s"] for r in records),
        "cpu_busy": median(r["cpu_s"] / r["step_s"] for r in records),
        "waits": records[0]["waits"],
        "actions": records[0]["actions"],
        "slot_bubble": None if idle is None else idle / total,
        "idle_slots": idle,
        "slots": total,
    }


def print_summary(summary: dict[str, Any]) -> None:
    """The human-readable tables: per mode, then per rank."""
    cfg = summary["config"]
    print(
        f"ranks={cfg['ranks']} pp={cfg['pp']} vpp={cfg['vpp']} schedule={cfg['schedule']} dp={cfg['dp']} "
        f"ep={cfg['ep'] or cfg['dp']} layers={cfg['layers']} hidden={cfg['hidden']} ffn={cfg['ffn']} "
        f"dense_ffn={cfg['dense_ffn']} experts={cfg['experts']} top_k={cfg['top_k']} tokens={cfg['tokens']} "
        f"microbatches={cfg['microbatches']} dispatcher={cfg['dispatcher']} device={cfg['device']} "
        f"torch={summary['torch']}; medians of {cfg['steps']} steps after {cfg['warmup']}"
    )
    modes = summary["modes"]
    print(f"each overlapped run bitwise its schedule run sequentially: {summary['bitwise_equal']}")
    base = next(iter(modes))
    print(f"{'run':<23} {'step ms':>8} {'/ ' + base:>20} {'bubble':>7} {'exposed a2a ms':>15} {'hidden':>7} "
          f"{'limit':>6}")  # fmt: skip
    for mode, v in modes.items():
        print(f"{mode:<23} {1e3 * v['step_s']:8.1f} {v['ratio']:20.3f} {v['bubble_mean']:7.3f} "
              f"{1e3 * v['exposed_s']:15.1f} {v['hidden']:7.2f} {v['limit']:6.3f}")  # fmt: skip
    print(f"{'mode':<11} {'step ms':>8} {'ratio':>6} {'schedule ms':>12}  stage concurrency per pipeline")
    for mode, v in modes.items():
        together = " ".join(f"{c:.2f}" for c in v["concurrency"])
        print(f"{mode:<11} {1e3 * v['step_s']:8.1f} {v['ratio']:6.3f} {1e3 * v['schedule_s']:12.1f}  {together}")
    print(
        f"{'mode':<11} {'rank':>4} {'pp':>3} {'ep':>3} {'stages':>7} {'slots idle':>11} {'bubble':>7} "
        f"{'schedule ms':>12} {'compute ms':>11} {'exposed a2a ms':>15} {'waits':>6} {'CPU busy':>9}"
    )
    for mode, v in modes.items():
        for rank, r in enumerate(v["ranks"]):
            slots = f"{r['idle_slots']}/{r['slots']}" if r["slots"] else "n/a"
            stages = ",".join(str(i) for i in r["stages"])
            print(
                f"{mode:<11} {rank:4d} {r['coords']['pp']:3d} {r['coords']['ep']:3d} {stages:>7} {slots:>11} "
                f"{r['bubble']:7.3f} {1e3 * r['schedule_s']:12.1f} {1e3 * r['busy_s']:11.1f} "
                f"{1e3 * r['blocked_s']:15.1f} {r['waits']:6d} {r['cpu_busy']:9.2f}"
            )
    for mode, order in summary["orders"].items():
        if order:
            print(f"{mode} order (torch's pipeline_order, '.' idle):\n{order}")
