"""Step time of expert-parallel MoE training with and without overlap, and the communication it hides.

Launches ``--ranks`` processes (gloo on CPU by default; ``--device cuda`` uses NCCL and one GPU per rank) and
trains one model three ways in the same run, steps interleaved (A B C A B C ...) so that drift affects all alike:

- ``sequential``: ``OverlapEngine(overlap=False)``, ``F0, B0, F1, B1, ...``;
- ``overlap``: ``overlap=True``, the forward of micro-batch ``i+1`` paired with the backward of ``i``;
- ``overlap+wgrad``: ``overlap=True`` with ``CommRuntime(delay_wgrad=True)``;
- ``overlap+monitor`` (with ``--monitor``): ``overlap`` plus the hot-path instrumentation of ``MoEMonitor``
  (routing statistics on the device) and its read-out every step (one all-reduce, one device-to-host copy), the
  worst case of ``log_every_n_steps=1``; its ratio to ``overlap`` is the monitor's overhead;
- ``sequential/plain`` and ``overlap/plain`` (with ``--compare-dedup``): the all-to-all dispatcher without its
  deduplicated dispatch (one row per (token, expert) instead of per (token, rank)); each step also counts the
  bytes the all-to-alls send to other ranks.

The model is a stack of blocks ``x + MoE(x + MLP(x))``: a dense GELU MLP (the compute before the dispatch) and
an expert-parallel :class:`MoELayer`, trained with the engine, ``sync_gradients`` and SGD. Every all-to-all
wait is timed with a :class:`CommTimer`; see ``docs/benchmarks.md`` for what each printed number means.

Usage: ``python benchmarks/overlap.py [--ranks 2] [--hidden 1024] [--microbatches 12] [--steps 20] [--json]``
(``--help`` lists every option). ``--simulate-ep MS`` runs one rank whose all-to-alls are loopbacks of ``MS``
milliseconds (simulated expert parallelism on one GPU, ``simulated_ep.py``); ``--trace PATH`` then writes one
overlapped step as a Chrome trace. ``--pp P [--vpp V] [--pipeline-schedule NAME]`` cuts the blocks into ``P * V``
pipeline chunks and runs torch's schedule with overlap off and on, reporting the bubble per rank
(``pipelined.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

import pipelined
from simulated_ep import count_host_syncs, export_trace, loopback, make_deterministic

from lightning_moe_overlap.parallel.grads import sync_gradients
from lightning_moe_overlap.moe.ep import apply_expert_parallel
from lightning_moe_overlap.parallelize.compile_regions import compile_dense_regions
from lightning_moe_overlap.moe.layer import MoELayer
from lightning_moe_overlap.moe.stats import RoutingStats, summarize
from lightning_moe_overlap.overlap.engine import OverlapEngine
from lightning_moe_overlap.overlap.observers import CommTimer, CommTraffic
from lightning_moe_overlap.overlap.runtime import CommRuntime
from lightning_moe_overlap.overlap.schedule import Task
from lightning_moe_overlap.config import default_schedule
from lightning_moe_overlap.parallel import ParallelDims, ParallelDimsError, ParallelGroups, build_mesh
from lightning_moe_overlap.pipeline.schedules import validate_schedule

MODES: dict[str, tuple[bool, bool]] = {  # name -> (overlap, delay_wgrad)
    "sequential": (False, False),
    "overlap": (True, False),
    "overlap+wgrad": (True, True),
}
MONITOR_MODE = "overlap+monitor"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PLAIN_MODES = {"sequential/plain": (False, False), "overlap/plain": (True, False)}  # dedup=False
COMPILED_MODES = {"sequential/compiled": (False, False), "overlap/compiled": (True, False)}  # compile=True
ALL_MODES = {**MODES, MONITOR_MODE: (True, False), **PLAIN_MODES, **COMPILED_MODES}


def modes_of(cfg: Config) -> list[str]:
    """The modes a run measures."""
    if cfg.pp > 1:
        return list(pipelined.pp_modes(cfg))
    return [*MODES, *([MONITOR_MODE] if cfg.monitor else []), *(PLAIN_MODES if cfg.compare_dedup else []),
            *(COMPILED_MODES if cfg.compare_compile else [])]  # fmt: skip


@dataclass(frozen=True)
class Config:
    """One benchmark configuration (the command-line options).

    Attributes:
        ranks: processes, one per GPU with ``device="cuda"``; ``pp x dp``.
        ep: expert-parallel size (default ``ranks / pp``, all of dp); the rest of the dp ranks is data parallel.
        pp: pipeline-parallel size; > 1 runs ``pipelined.py``'s modes (``layers`` divisible by ``pp * vpp``).
        vpp: pipeline stages (chunks) per rank.
        pipeline_schedule: ``"1f1b"``, ``"interleaved_1f1b"`` or ``"dualpipev"``; ``None``: the default at ``vpp``.
        layers: blocks of the model.
        hidden: hidden size ``D``.
        ffn: ffn size of each routed expert.
        dense_ffn: ffn size of the dense MLP before each MoE layer.
        experts: routed experts per layer (divisible by ``ep``).
        top_k: experts per token.
        tokens: tokens per micro-batch and rank.
        microbatches: micro-batches per optimizer step.
        steps: measured steps per mode; warmup: unmeasured steps per mode before them.
        dispatcher: ``"alltoall"``, ``"allgather"`` or ``"flex"``.
        device: ``"cpu"`` or ``"cuda"``; backend: process-group backend (default gloo on CPU, NCCL on CUDA).
        threads: ``torch.set_num_threads`` per rank.
        seed: initialisation seed (the same model on every rank and in every mode).
        simulate_ep_ms: > 0: simulated expert parallelism (one rank, every all-to-all a loopback of this many ms).
        trace: with ``simulate_ep_ms``, write one overlapped step as a Chrome trace to this path.
        monitor: also measure ``overlap+monitor`` (the overhead of ``MoEMonitor``).
        dedup: the all-to-all dispatcher's deduplicated dispatch (off by default, as in the strategy).
        compare_dedup: run the main modes deduplicated and also measure ``sequential/plain`` and ``overlap/plain``
            (``dedup=False``).
        shared_ffn: > 0: each MoE layer also has a shared expert of this ffn size, run inside the dispatch window
            (``shared_expert_overlap=True``).
        deterministic: with ``simulate_ep_ms``, deterministic kernels for the bitwise comparison of the modes;
            ``False`` asks whether overlapped and sequential steps still agree bitwise without them.
        compare_schedules: with ``pp > 1``: 1F1B, interleaved 1F1B (vpp=2) and DualPipeV (vpp=2), each sequential and
            overlapped, in one run (``pipelined.COMPARED``); ``vpp`` and ``pipeline_schedule`` are ignored.
        a2a_delay_ms: with ``pp > 1``: every EP all-to-all lasts at least this long (a wait returns no earlier than
            this after the issue), so the communication is large enough to see on CPU.
        dtype: ``"float32"`` or ``"bfloat16"``: the parameters and activations (bf16 takes ``torch._grouped_mm`` on
            CUDA, where float32 takes the per-expert loop).
        static: the all-to-all dispatcher's static layout (``alltoall_static``: no host read per layer).
        compare_compile: also measure ``sequential/compiled`` and ``overlap/compiled``: the dense regions of every
            block through ``torch.compile`` (``compile=True``, ``parallelize/compile_regions.py``), the experts eager.
    """

    ranks: int = 2
    ep: int | None = None
    pp: int = 1
    vpp: int = 1
    pipeline_schedule: str | None = None
    layers: int = 4
    hidden: int = 1024
    ffn: int = 32
    dense_ffn: int = 32
    experts: int = 4
    top_k: int = 2
    tokens: int = 128
    microbatches: int = 12
    steps: int = 20
    warmup: int = 3
    dispatcher: str = "alltoall"
    device: str = "cpu"
    backend: str | None = None
    threads: int = 1
    seed: int = 0
    simulate_ep_ms: float = 0.0
    trace: str | None = None
    monitor: bool = False
    dedup: bool = False
    compare_dedup: bool = False
    shared_ffn: int = 0
    deterministic: bool = True
    compare_schedules: bool = False
    a2a_delay_ms: float = 0.0
    dtype: str = "float32"
    static: bool = False
    compare_compile: bool = False

    @property
    def ep_size(self) -> int:
        """The expert-parallel size (``ranks / pp`` when ``ep`` is not set)."""
        return self.ep or self.ranks // self.pp

    @property
    def schedule_name(self) -> str:
        """The pipeline schedule (``pipeline_schedule``, or the default at ``vpp``)."""
        return self.pipeline_schedule or default_schedule(self.vpp)

    @property
    def backend_name(self) -> str:
        """The process-group backend."""
        return self.backend or ("nccl" if self.device == "cuda" else "gloo")


# -- model ---------------------------------------------------------------------------------------------------------
class Block(nn.Module):
    """``x + MoE(x + MLP(x))``: dense compute before the dispatch, then the MoE layer."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden)
        self.mlp = nn.Sequential(nn.Linear(cfg.hidden, cfg.dense_ffn), nn.GELU(), nn.Linear(cfg.dense_ffn, cfg.hidden))
        shared = (
            {"shared_expert_ffn_hidden_size": cfg.shared_ffn, "shared_expert_overlap": True} if cfg.shared_ffn else {}
        )
        self.moe = MoELayer(cfg.hidden, cfg.ffn, cfg.experts, cfg.top_k, **shared)

    def forward(self, x: Tensor) -> Tensor:
        h = x + self.mlp(self.norm(x))
        return h + self.moe(h)


class Net(nn.Module):
    """A stack of :class:`Block` (same initialisation on every rank and in every mode)."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        torch.manual_seed(cfg.seed)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


# -- CPU contention --------------------------------------------------------------------------------------------------
def _run_delay_s(path: str) -> float | None:
    """Seconds the thread of a ``schedstat`` file was runnable but not running (Linux); ``None`` if unreadable."""
    try:
        with open(path) as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class RunDelay:
    """Time this process's threads spent runnable but waiting for a core, over one step (Linux ``schedstat``).

    Threads alive for the whole step (the main thread, the process group's threads) are read at its start and
    end; the engine's lanes, which live for one step, are read around each task through ``context_factory``.
    Reads 0 where ``/proc`` has no ``schedstat``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lanes_s = 0.0
        self._start: dict[str, float] = {}

    @staticmethod
    def _threads() -> dict[str, float]:
        try:
            tids = os.listdir("/proc/self/task")
        except OSError:
            return {}
        delays = {tid: _run_delay_s(f"/proc/self/task/{tid}/schedstat") for tid in tids}
        return {tid: d for tid, d in delays.items() if d is not None}

    def start(self) -> None:
        """Begin a step."""
        self._lanes_s = 0.0
        self._start = self._threads()

    def stop(self) -> float:
        """End the step; returns its run delay in seconds, summed over threads."""
        end = self._threads()
        return self._lanes_s + sum(end[t] - self._start[t] for t in end.keys() & self._start.keys())

    @contextmanager
    def lane(self, task: Task) -> Iterator[None]:
        """The ``context_factory`` of the engine: adds the lane's run delay during ``task``."""
        before = _run_delay_s("/proc/thread-self/schedstat")
        try:
            yield
        finally:
            after = _run_delay_s("/proc/thread-self/schedstat")
            if before is not None and after is not None:
                with self._lock:
                    self._lanes_s += after - before


# -- one mode ------------------------------------------------------------------------------------------------------
@dataclass
class Trainer:
    """A model, its runtime, engine and optimizer, for one mode."""

    net: Net
    runtime: CommRuntime
    timer: CommTimer
    traffic: CommTraffic
    run_delay: RunDelay
    engine: OverlapEngine
    optimizer: torch.optim.Optimizer
    dense: list[nn.Parameter]
    expert: list[nn.Parameter]
    stats: RoutingStats | None = None


def build_trainer(cfg: Config, mode: str, groups: ParallelGroups, device: torch.device) -> Trainer:
    """Build the model of ``cfg`` for ``mode`` on ``device``, expert-parallel over ``groups.ep``."""
    overlap, delay_wgrad = ALL_MODES[mode]
    communicator = loopback(cfg.simulate_ep_ms, device) if cfg.simulate_ep_ms > 0 else None
    runtime = CommRuntime(delay_wgrad=delay_wgrad, communicator=communicator)
    net = Net(cfg).to(device=device, dtype=DTYPES[cfg.dtype])
    knobs = {}
    if cfg.dispatcher == "alltoall":
        knobs = {"dedup": cfg.dedup and mode not in PLAIN_MODES, "static": cfg.static}
    experts = apply_expert_parallel(net, groups.ep, dispatcher=cfg.dispatcher, runtime=runtime, **knobs)
    if mode in COMPILED_MODES:
        compile_dense_regions([net])
    traffic, timer = CommTraffic(), CommTimer()
    runtime.attach(traffic)
    runtime.attach(timer)
    expert_ids = {id(p) for module in experts for p in module.parameters()}
    params = list(net.parameters())
    run_delay = RunDelay()
    return Trainer(
        net=net,
        runtime=runtime,
        timer=timer,
        traffic=traffic,
        run_delay=run_delay,
        engine=OverlapEngine(runtime, overlap=overlap, context_factory=run_delay.lane, timeout_s=600),
        optimizer=torch.optim.SGD(params, lr=1e-3),
        dense=[p for p in params if id(p) not in expert_ids],
        expert=[p for p in params if id(p) in expert_ids],
        stats=RoutingStats(net) if mode == MONITOR_MODE else None,
    )


def read_monitor(stats: RoutingStats, groups: ParallelGroups, device: torch.device) -> None:
    """What ``MoEMonitor`` does at a logging step: pack, all-reduce over dp x cp, read once."""
    packed, layout = stats.pack(device)
    timing = torch.zeros(4, dtype=torch.float64, device=device)
    reduced = torch.cat([packed, timing])
    dist.all_reduce(reduced, group=groups.dp_cp)
    summarize([b.name for b in stats.blocks], reduced[: packed.numel()], layout, stats.bias_norms(device), steps=1)


def make_batch(cfg: Config, rank: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Inputs and targets ``[microbatches, tokens, hidden]``, different on every rank."""
    g = torch.Generator().manual_seed(1000 + rank)
    shape = (cfg.microbatches, cfg.tokens, cfg.hidden)
    dtype = DTYPES[cfg.dtype]
    return (torch.randn(shape, generator=g).to(device=device, dtype=dtype),
            torch.randn(shape, generator=g).to(device=device, dtype=dtype))  # fmt: skip


def train_step(t: Trainer, cfg: Config, groups: ParallelGroups, batch: tuple[Tensor, Tensor]) -> dict[str, float]:
    """One optimizer step; returns its wall time and the communication times recorded during it."""
    x, y = batch
    m = cfg.microbatches
    t.timer.reset()
    t.traffic.reset()
    t.run_delay.start()
    cpu_start = time.process_time()
    start = time.perf_counter()
    t.optimizer.zero_grad(set_to_none=False)
    t.engine.run(lambda i: nn.functional.mse_loss(t.net(x[i]), y[i]), lambda i, loss: (loss / m).backward(), m)
    engine_end = time.perf_counter()
    dp_cp_size = dist.get_world_size(groups.dp_cp)
    sync_gradients(t.dense, t.expert, dp_cp_group=groups.dp_cp, edp_group=groups.edp, dp_cp_size=dp_cp_size)
    t.optimizer.step()
    if t.stats is not None:
        read_monitor(t.stats, groups, x.device)
    device_sync(x.device)
    end = time.perf_counter()
    cpu = time.process_time() - cpu_start
    comm = t.timer.snapshot()
    _, sent_bytes, remote_bytes = t.traffic.reset()
    return {
        "sent_bytes": sent_bytes,
        "remote_bytes": remote_bytes,
        "step_s": end - start,
        "cpu_s": cpu,
        "run_delay_s": t.run_delay.stop(),
        "engine_s": engine_end - start,
        "blocked_s": comm.blocked_s,
        "in_flight_s": comm.in_flight_s,
        "waits": comm.waits,
    }


def device_sync(device: torch.device) -> None:
    """Wait for queued device work (nothing to do on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def align(device: torch.device) -> None:
    """Start every step on all ranks together: a tiny all-reduce, then wait for it."""
    device_sync(device)
    dist.all_reduce(torch.zeros(1, device=device))
    device_sync(device)


def device_comm_probe(t: Trainer, cfg: Config, groups: ParallelGroups, batch: tuple[Tensor, Tensor]) -> float:
    """CUDA only: EP communication of one sequential step, timed on the device (blocks the host at each wait)."""
    with t.runtime.attach(CommTimer(synchronize=lambda: torch.cuda.current_stream().synchronize())) as probe:
        align(batch[0].device)
        train_step(t, cfg, groups, batch)
        return probe.snapshot().blocked_s


# -- one rank ------------------------------------------------------------------------------------------------------
def rank_main(rank: int, cfg: Config) -> dict[str, Any]:
    """Run every mode, interleaved; return this rank's per-step records."""
    device = torch.device(f"cuda:{rank}") if cfg.device == "cuda" else torch.device("cpu")
    dims = ParallelDims.from_world_size(cfg.ranks, pp=cfg.pp, ep=cfg.ep_size)
    groups = build_mesh(dims, device.type).process_groups(rank)  # as the strategy makes them: one mesh's views
    if cfg.pp > 1:
        batch = make_batch(cfg, groups.coords.dp, device)  # the ranks of one pp group share their data
        return pipelined.rank_main(rank, cfg, groups, device, lambda: Net(cfg).to(device), batch, align)
    trainers = {mode: build_trainer(cfg, mode, groups, device) for mode in modes_of(cfg)}
    batch = make_batch(cfg, rank, device)
    records: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes_of(cfg)}
    for step in range(cfg.warmup + cfg.steps):
        for mode, trainer in trainers.items():
            align(device)
            record = train_step(trainer, cfg, groups, batch)
            if step >= cfg.warmup:
                records[mode].append(record)
    # Per dispatch path and per compilation: deduplicated and plain agree bitwise only up to top-2
    # (docs/dispatchers.md); compiled regions round their fused element-wise work differently from eager.
    groups_of_modes = [[t for m, t in trainers.items() if m in kind] for kind in (MODES, PLAIN_MODES, COMPILED_MODES)]
    groups_of_modes[0] += [t for m, t in trainers.items() if m == MONITOR_MODE]
    equal = all(same_parameters(group) for group in groups_of_modes if group)
    probe, simulated = None, None
    if cfg.simulate_ep_ms > 0:
        simulated = simulated_extras(trainers["overlap"], cfg, groups, batch)
    elif device.type == "cuda":
        probe = [device_comm_probe(trainers["sequential"], cfg, groups, batch) for _ in range(3)]
    return {"records": records, "device_comm_s": probe, "bitwise_equal": equal, "simulated": simulated}


def simulated_extras(t: Trainer, cfg: Config, groups: ParallelGroups, batch: tuple[Tensor, Tensor]) -> dict:
    """Host syncs of one overlapped step, and its Chrome trace (``cfg.trace``), after the measured steps."""
    device = batch[0].device

    def step() -> None:
        train_step(t, cfg, groups, batch)

    syncs = count_host_syncs(step, device)
    trace = export_trace(step, cfg.trace, device) if cfg.trace else None
    return {"host_syncs_per_step": syncs, "trace": trace}


def same_parameters(trainers: list[Trainer]) -> bool:
    """Whether every mode trained to bitwise the same parameters (they ran the same steps on the same data)."""
    reference = list(trainers[0].net.parameters())
    return all(
        torch.equal(p, q) for t in trainers[1:] for p, q in zip(reference, t.net.parameters(), strict=True)
    )


def rank_entry(rank: int, cfg: Config, port: int, queue: Any) -> None:
    """Process entry point: set up the process group, run, send the result (or the traceback) back."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(cfg.threads)
    if cfg.simulate_ep_ms > 0 and cfg.deterministic:
        make_deterministic()
    if cfg.device == "cuda":
        torch.cuda.set_device(rank)
    try:
        dist.init_process_group(
            cfg.backend_name, rank=rank, world_size=cfg.ranks, timeout=timedelta(seconds=600)
        )
        queue.put((rank, True, rank_main(rank, cfg)))
    except BaseException:  # noqa: BLE001 - reported by the launcher
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def free_port() -> int:
    """An unused TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(ranks: int, target: Callable[..., None], *args: Any) -> list[Any]:
    """Run ``target(rank, *args, port, queue)`` in one spawned process per rank; their results, index = rank.

    Each rank puts ``(rank, ok, payload)`` on ``queue``: its result, or the traceback that is raised here.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, *args, port, queue), daemon=True) for r in range(ranks)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(ranks):
            rank, ok, payload = queue.get(timeout=1800)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(ranks)]


def launch(cfg: Config) -> list[dict[str, Any]]:
    """Spawn one process per rank and collect their results (index = rank)."""
    return spawn_ranks(cfg.ranks, rank_entry, cfg)


# -- summary -------------------------------------------------------------------------------------------------------
def per_step(results: list[dict[str, Any]], mode: str, key: str, reduce: Any) -> list[float]:
    """``key`` of every measured step of ``mode``, reduced over ranks (``max`` or ``mean``)."""
    per_rank = [r["records"][mode] for r in results]
    return [reduce([records[i][key] for records in per_rank]) for i in range(len(per_rank[0]))]


def mode_summary(results: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    """Medians over the steps of ``mode``: step time of the slowest rank, the other figures averaged over ranks."""
    median = statistics.median
    mean_over_ranks = {
        key: median(per_step(results, mode, key, statistics.fmean))
        for key in ("blocked_s", "in_flight_s", "cpu_s", "run_delay_s")
    }
    return {
        "step_s": median(per_step(results, mode, "step_s", max)),
        "engine_s": median(per_step(results, mode, "engine_s", max)),
        **mean_over_ranks,
        "waits": results[0]["records"][mode][0]["waits"],
        "remote_bytes": median(per_step(results, mode, "remote_bytes", sum)),
        "sent_bytes": median(per_step(results, mode, "sent_bytes", sum)),
        "steps_s": per_step(results, mode, "step_s", max),
        "per_rank_cpu_s": [median(r["cpu_s"] for r in res["records"][mode]) for res in results],
        "per_rank_blocked_s": [median(r["blocked_s"] for r in res["records"][mode]) for res in results],
    }


def summarise(results: list[dict[str, Any]], cfg: Config) -> dict[str, Any]:
    """Every mode's figures, the sequential run's split into compute and communication, and the limit."""
    if cfg.pp > 1:
        return pipelined.summarise(results, cfg)
    modes = {mode: mode_summary(results, mode) for mode in modes_of(cfg)}
    seq = modes["sequential"]
    probe = results[0]["device_comm_s"]
    comm = statistics.median(probe) if probe else seq["blocked_s"]
    if cfg.simulate_ep_ms > 0:  # known: every all-to-all lasts simulate_ep_ms
        comm = seq["waits"] * cfg.simulate_ep_ms / 1e3
    compute = seq["step_s"] - comm
    for values in modes.values():
        values["ratio"] = statistics.median(a / b for a, b in zip(values["steps_s"], seq["steps_s"]))
        values["exposed_est_s"] = values["step_s"] - compute
        values["cpu_busy"] = values["cpu_s"] / values["step_s"]
    return {
        "config": asdict(cfg),
        "torch": torch.__version__,
        "comm_s": comm,
        "compute_s": compute,
        "limit": max(compute, comm) / (compute + comm),
        "host_waits_meaningful": probe is None and not (cfg.simulate_ep_ms > 0 and cfg.device == "cuda"),
        "bitwise_equal": all(r["bitwise_equal"] for r in results),
        "simulated": results[0]["simulated"],
        "modes": modes,
        "dedup": (
            {
                "bytes": modes["sequential"]["remote_bytes"] / modes["sequential/plain"]["remote_bytes"],
                **{
                    mode: statistics.median(
                        a / b for a, b in zip(modes[mode]["steps_s"], modes[f"{mode}/plain"]["steps_s"])
                    )
                    for mode in ("sequential", "overlap")
                },
            }
            if cfg.compare_dedup and modes["sequential/plain"]["remote_bytes"]
            else None
        ),
        "compiled": (
            {mode: statistics.median(a / b for a, b in zip(modes[f"{mode}/compiled"]["steps_s"],
                                                           modes[mode]["steps_s"]))
             for mode in ("sequential", "overlap")}
            if cfg.compare_compile
            else None
        ),  # fmt: skip
        "monitor_overhead": (
            statistics.median(a / b for a, b in zip(modes[MONITOR_MODE]["steps_s"], modes["overlap"]["steps_s"])) - 1
            if MONITOR_MODE in modes
            else None
        ),
    }


def print_summary(summary: dict[str, Any]) -> None:
    """The human-readable table."""
    cfg = summary["config"]
    if cfg["pp"] > 1:
        pipelined.print_summary(summary)
        return
    print(
        f"ranks={cfg['ranks']} ep={cfg['ep'] or cfg['ranks']} layers={cfg['layers']} hidden={cfg['hidden']} "
        f"ffn={cfg['ffn']} dense_ffn={cfg['dense_ffn']} experts={cfg['experts']} top_k={cfg['top_k']} "
        f"tokens={cfg['tokens']} microbatches={cfg['microbatches']} dispatcher={cfg['dispatcher']} "
        f"static={cfg['static']} dtype={cfg['dtype']} device={cfg['device']} torch={summary['torch']}; "
        f"medians of {cfg['steps']} steps after {cfg['warmup']}"
    )
    print(
        f"sequential step = compute {1e3 * summary['compute_s']:.1f} ms + EP communication "
        f"{1e3 * summary['comm_s']:.1f} ms; limit max(compute, comm) / (compute + comm) = {summary['limit']:.3f}"
    )
    print(f"parameters after the run bitwise equal in every mode (per dispatch path and per compilation): "
          f"{summary['bitwise_equal']}")
    if summary["simulated"] is not None:
        sim = summary["simulated"]
        print(f"simulated EP: every all-to-all {cfg['simulate_ep_ms']} ms; host syncs per overlapped step: "
              f"{sim['host_syncs_per_step']}; trace: {sim['trace']}")
    host = summary["host_waits_meaningful"]
    print(f"{'mode':<19} {'step ms':>8} {'ratio':>6} {'exposed ms':>11} {'step-compute ms':>16} {'CPU busy':>9} "
          f"{'run-queue ms':>13} {'sent MB':>8}")
    for mode, v in summary["modes"].items():
        exposed = f"{1e3 * v['blocked_s']:11.1f}" if host else f"{'n/a':>11}"
        print(
            f"{mode:<19} {1e3 * v['step_s']:8.1f} {v['ratio']:6.3f} {exposed} {1e3 * v['exposed_est_s']:16.1f} "
            f"{v['cpu_busy']:9.2f} {1e3 * v['run_delay_s']:13.1f} {v['remote_bytes'] / 1e6:8.2f}"
        )
    dedup = summary["dedup"]
    if dedup is not None:
        print(
            f"deduplicated / plain all-to-all (median of steps): bytes sent to other ranks {dedup['bytes']:.3f}, "
            f"step time sequential {dedup['sequential']:.3f}, overlapped {dedup['overlap']:.3f}"
        )
    if summary["compiled"] is not None:
        compiled = summary["compiled"]
        print(f"compiled / eager step time (median of steps): sequential {compiled['sequential']:.3f}, "
              f"overlapped {compiled['overlap']:.3f}")  # fmt: skip
    if summary["monitor_overhead"] is not None:
        print(f"MoEMonitor overhead (overlap+monitor / overlap - 1, median of steps): {summary['monitor_overhead']:+.2%}")


HELP = {
    "ranks": "processes (one per GPU with --device cuda)",
    "layers": "blocks of the model",
    "hidden": "hidden size",
    "ffn": "ffn size of each routed expert",
    "dense_ffn": "ffn size of the dense MLP before each MoE layer",
    "experts": "routed experts per layer",
    "top_k": "experts per token",
    "tokens": "tokens per micro-batch and rank",
    "microbatches": "micro-batches per optimizer step",
    "steps": "measured steps per mode",
    "warmup": "unmeasured steps per mode first",
    "threads": "torch threads per rank",
    "seed": "initialisation seed",
}


def parse_args(argv: list[str] | None = None) -> tuple[Config, bool]:
    """The :class:`Config` and whether to print JSON."""
    defaults = Config()
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    for name, text in HELP.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name), help=text)
    parser.add_argument("--ep", type=int, default=None, help="expert-parallel size (None: --ranks / --pp)")
    parser.add_argument("--pp", type=int, default=defaults.pp, help="pipeline-parallel size (--ranks = pp x dp)")
    parser.add_argument("--vpp", type=int, default=defaults.vpp, help="pipeline stages (chunks) per rank")
    parser.add_argument(
        "--pipeline-schedule", default=None, choices=pipelined.SCHEDULES,
        help="with --pp > 1: torch's schedule (None: 1f1b at --vpp 1, interleaved_1f1b above)",
    )
    parser.add_argument("--dispatcher", default=defaults.dispatcher, choices=("alltoall", "allgather", "flex"))
    parser.add_argument("--device", default=defaults.device, choices=("cpu", "cuda"))
    parser.add_argument("--backend", default=None, help="process-group backend (None: gloo on CPU, nccl on CUDA)")
    parser.add_argument(
        "--simulate-ep", dest="simulate_ep_ms", type=float, default=0.0, metavar="MS",
        help="simulated expert parallelism: one rank, every all-to-all a loopback of MS milliseconds",
    )
    parser.add_argument("--trace", default=None, help="with --simulate-ep: Chrome trace of one overlapped step")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--monitor", action="store_true", help="also measure overlap+monitor (MoEMonitor's overhead)")
    parser.add_argument(
        "--dedup", action="store_true",
        help="alltoall: deduplicated dispatch, one row per (token, rank) on the wire, not per (token, expert)",
    )
    parser.add_argument(
        "--compare-dedup", action="store_true",
        help="run the main modes with --dedup and also measure sequential/plain and overlap/plain (without it)",
    )
    parser.add_argument("--dtype", default=defaults.dtype, choices=tuple(DTYPES), help="parameters and activations")
    parser.add_argument(
        "--static", action="store_true", help="alltoall: the static layout (fixed slots, no host read per layer)"
    )
    parser.add_argument(
        "--compare-compile", action="store_true",
        help="also measure sequential/compiled and overlap/compiled (torch.compile of every block's dense parts)",
    )
    parser.add_argument("--shared-ffn", type=int, default=0, help="ffn size of a shared expert per MoE layer (0: none)")
    parser.add_argument(
        "--compare-schedules", action="store_true",
        help="with --pp: 1f1b, interleaved_1f1b (vpp 2) and dualpipev (vpp 2), sequential and overlapped, in one run",
    )
    parser.add_argument(
        "--a2a-delay-ms", type=float, default=0.0, metavar="MS",
        help="with --pp: every EP all-to-all lasts at least MS milliseconds (simulated network latency)",
    )
    parser.add_argument(
        "--nondeterministic", dest="deterministic", action="store_false",
        help="with --simulate-ep: leave deterministic algorithms off (is overlapped still bitwise sequential?)",
    )
    args = vars(parser.parse_args(argv))
    as_json = args.pop("json")
    if args["simulate_ep_ms"] > 0:
        args.update(ranks=1, ep=1)
    if args["compare_dedup"]:
        args["dedup"] = True
    cfg = Config(**args)
    if cfg.pp != 1 or cfg.vpp != 1 or cfg.pipeline_schedule is not None or cfg.compare_schedules or cfg.a2a_delay_ms:
        problem = pipeline_problem(cfg)
        if problem:
            parser.error(problem)
    return cfg, as_json


def pipeline_problem(cfg: Config) -> str | None:
    """Why the pipeline options of ``cfg`` cannot run (the values, the rule, the fix); ``None`` if they can."""
    if cfg.pp < 1 or cfg.vpp < 1:
        return f"--pp {cfg.pp} / --vpp {cfg.vpp}: both must be >= 1."
    if cfg.pp == 1:
        return (
            f"--vpp {cfg.vpp} / --pipeline-schedule {cfg.pipeline_schedule} / --compare-schedules / --a2a-delay-ms "
            "need --pp >= 2, got --pp 1."
        )
    if cfg.a2a_delay_ms < 0:
        return f"--a2a-delay-ms {cfg.a2a_delay_ms:g}: must be >= 0."
    extras = [flag for flag, on in (("--simulate-ep", cfg.simulate_ep_ms > 0), ("--monitor", cfg.monitor),
                                    ("--compare-dedup", cfg.compare_dedup),
                                    ("--compare-compile", cfg.compare_compile)) if on]
    if extras:
        return f"--pp {cfg.pp} measures overlap off and on only; drop {', '.join(extras)} or use --pp 1."
    if cfg.device != "cpu":
        return f"--pp {cfg.pp} runs on CPU (gloo) only so far; use --device cpu or --pp 1."
    runs = pipelined.pp_modes(cfg).values()
    chunks = max(cfg.pp * vpp for _, vpp, _ in runs)
    if cfg.layers % chunks:
        return f"--layers {cfg.layers} must split evenly into pp * vpp = {chunks} chunks; use a multiple of {chunks}."
    try:
        ParallelDims.from_world_size(cfg.ranks, pp=cfg.pp, ep=cfg.ep_size)
        for schedule, vpp, overlap in runs:
            validate_schedule(schedule, pp=cfg.pp, vpp=vpp, num_microbatches=cfg.microbatches, overlap=overlap)
    except (ParallelDimsError, ValueError, NotImplementedError) as err:
        return str(err)
    return None


def _cpu_times() -> tuple[int, int] | None:
    """(idle, total) jiffies of all cores from ``/proc/stat``; ``None`` where there is none."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return values[3] + values[4], sum(values)


def busy_warning(sample_s: float = 0.5) -> str | None:
    """A warning when other processes keep the cores busy before the start (timings would measure them too)."""
    before = _cpu_times()
    time.sleep(sample_s)
    after = _cpu_times()
    if before is None or after is None or after[1] == before[1]:
        return None
    busy = 1 - (after[0] - before[0]) / (after[1] - before[1])
    if busy < 0.2:
        return None
    return f"warning: the cores were {busy:.0%} busy before the start; other processes compete with the ranks."


def main(argv: list[str] | None = None) -> None:
    """Parse the options, run every mode on every rank, print the summary."""
    cfg, as_json = parse_args(argv)
    warning = busy_warning()
    if warning:
        print(warning, file=sys.stderr)
    summary = summarise(launch(cfg), cfg)
    if as_json:
        print(json.dumps(summary, indent=2))
    else:
        print_summary(summary)


if __name__ == "__main__":
    main()
