"""Step time of expert-parallel MoE training with and without overlap, and the communication it hides.

Launches ``--ranks`` processes (gloo on CPU by default; ``--device cuda`` uses NCCL and one GPU per rank) and
trains one model three ways in the same run, steps interleaved (A B C A B C ...) so that drift affects all alike:

- ``sequential``: ``OverlapEngine(overlap=False)``, ``F0, B0, F1, B1, ...``;
- ``overlap``: ``overlap=True``, the forward of micro-batch ``i+1`` paired with the backward of ``i``;
- ``overlap+wgrad``: ``overlap=True`` with ``CommRuntime(delay_wgrad=True)``.

The model is a stack of blocks ``x + MoE(x + MLP(x))``: a dense GELU MLP (the compute before the dispatch) and
an expert-parallel :class:`MoELayer`, trained with the engine, ``sync_gradients`` and SGD. Every all-to-all
wait is timed with a :class:`CommTimer`; see ``docs/benchmarks.md`` for what each printed number means.

Usage: ``python benchmarks/overlap.py [--ranks 2] [--steps 12] [--json]``
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from lightning_moe_overlap.grads import sync_gradients
from lightning_moe_overlap.moe.adapters import apply_expert_parallel
from lightning_moe_overlap.moe.layer import MoELayer
from lightning_moe_overlap.overlap.engine import OverlapEngine
from lightning_moe_overlap.overlap.runtime import CommRuntime, CommTimer
from lightning_moe_overlap.parallel import ParallelDims, ParallelGroups, build_groups

MODES: dict[str, tuple[bool, bool]] = {  # name -> (overlap, delay_wgrad)
    "sequential": (False, False),
    "overlap": (True, False),
    "overlap+wgrad": (True, True),
}


@dataclass(frozen=True)
class Config:
    """One benchmark configuration (the command-line options)."""

    ranks: int = 2
    ep: int | None = None
    layers: int = 4
    hidden: int = 256
    ffn: int = 512
    dense_ffn: int = 512
    experts: int = 4
    top_k: int = 2
    tokens: int = 1024
    microbatches: int = 6
    steps: int = 12
    warmup: int = 3
    dispatcher: str = "alltoall"
    device: str = "cpu"
    backend: str | None = None
    threads: int = 1
    seed: int = 0

    @property
    def ep_size(self) -> int:
        return self.ep or self.ranks

    @property
    def backend_name(self) -> str:
        return self.backend or ("nccl" if self.device == "cuda" else "gloo")


# -- model ---------------------------------------------------------------------------------------------------------
class Block(nn.Module):
    """``x + MoE(x + MLP(x))``: dense compute before the dispatch, then the MoE layer."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden)
        self.mlp = nn.Sequential(nn.Linear(cfg.hidden, cfg.dense_ffn), nn.GELU(), nn.Linear(cfg.dense_ffn, cfg.hidden))
        self.moe = MoELayer(cfg.hidden, cfg.ffn, cfg.experts, cfg.top_k)

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


# -- one mode ------------------------------------------------------------------------------------------------------
@dataclass
class Trainer:
    """A model, its runtime, engine and optimizer, for one mode."""

    net: Net
    runtime: CommRuntime
    timer: CommTimer
    engine: OverlapEngine
    optimizer: torch.optim.Optimizer
    dense: list[nn.Parameter]
    expert: list[nn.Parameter]


def build_trainer(cfg: Config, mode: str, groups: ParallelGroups, device: torch.device) -> Trainer:
    """Build the model of ``cfg`` for ``mode`` on ``device``, expert-parallel over ``groups.ep``."""
    overlap, delay_wgrad = MODES[mode]
    runtime = CommRuntime(delay_wgrad=delay_wgrad)
    net = Net(cfg).to(device)
    experts = apply_expert_parallel(net, groups.ep, dispatcher=cfg.dispatcher, runtime=runtime)
    expert_ids = {id(p) for module in experts for p in module.parameters()}
    params = list(net.parameters())
    timer = CommTimer()
    runtime.timing = timer
    return Trainer(
        net=net,
        runtime=runtime,
        timer=timer,
        engine=OverlapEngine(runtime, overlap=overlap, timeout_s=600),
        optimizer=torch.optim.SGD(params, lr=1e-3),
        dense=[p for p in params if id(p) not in expert_ids],
        expert=[p for p in params if id(p) in expert_ids],
    )


def make_batch(cfg: Config, rank: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Inputs and targets ``[microbatches, tokens, hidden]``, different on every rank."""
    g = torch.Generator().manual_seed(1000 + rank)
    shape = (cfg.microbatches, cfg.tokens, cfg.hidden)
    return torch.randn(shape, generator=g).to(device), torch.randn(shape, generator=g).to(device)


def train_step(t: Trainer, cfg: Config, groups: ParallelGroups, batch: tuple[Tensor, Tensor]) -> dict[str, float]:
    """One optimizer step; returns its wall time and the communication times recorded during it."""
    x, y = batch
    m = cfg.microbatches
    t.timer.reset()
    start = time.perf_counter()
    t.optimizer.zero_grad(set_to_none=False)
    t.engine.run(lambda i: nn.functional.mse_loss(t.net(x[i]), y[i]), lambda i, loss: (loss / m).backward(), m)
    engine_end = time.perf_counter()
    sync_gradients(t.dense, t.expert, dp_cp_group=groups.dp_cp, edp_group=groups.edp, dp_cp_size=cfg.ranks)
    t.optimizer.step()
    device_sync(x.device)
    end = time.perf_counter()
    comm = t.timer.snapshot()
    return {
        "step_s": end - start,
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
    t.runtime.timing = CommTimer(synchronize=lambda: torch.cuda.current_stream().synchronize())
    try:
        align(batch[0].device)
        train_step(t, cfg, groups, batch)
        return t.runtime.timing.snapshot().blocked_s
    finally:
        t.runtime.timing = t.timer


# -- one rank ------------------------------------------------------------------------------------------------------
def rank_main(rank: int, cfg: Config) -> dict[str, Any]:
    """Run every mode, interleaved; return this rank's per-step records."""
    device = torch.device(f"cuda:{rank}") if cfg.device == "cuda" else torch.device("cpu")
    groups = build_groups(ParallelDims.from_world_size(cfg.ranks, ep=cfg.ep_size), rank)
    trainers = {mode: build_trainer(cfg, mode, groups, device) for mode in MODES}
    batch = make_batch(cfg, rank, device)
    records: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for step in range(cfg.warmup + cfg.steps):
        for mode, trainer in trainers.items():
            align(device)
            record = train_step(trainer, cfg, groups, batch)
            if step >= cfg.warmup:
                records[mode].append(record)
    probe = None
    if device.type == "cuda":
        probe = [device_comm_probe(trainers["sequential"], cfg, groups, batch) for _ in range(3)]
    return {"records": records, "device_comm_s": probe}


def rank_entry(rank: int, cfg: Config, port: int, queue: Any) -> None:
    """Process entry point: set up the process group, run, send the result (or the traceback) back."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(cfg.threads)
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


def launch(cfg: Config) -> list[dict[str, Any]]:
    """Spawn one process per rank and collect their results (index = rank)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_entry, args=(r, cfg, port, queue), daemon=True) for r in range(cfg.ranks)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(cfg.ranks):
            rank, ok, payload = queue.get(timeout=1800)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(cfg.ranks)]


# -- summary -------------------------------------------------------------------------------------------------------
def per_step(results: list[dict[str, Any]], mode: str, key: str, reduce: Any) -> list[float]:
    """``key`` of every measured step of ``mode``, reduced over ranks (``max`` or ``mean``)."""
    per_rank = [r["records"][mode] for r in results]
    return [reduce([records[i][key] for records in per_rank]) for i in range(len(per_rank[0]))]


def summarise(results: list[dict[str, Any]], cfg: Config) -> dict[str, Any]:
    """Medians over steps of step time (slowest rank) and communication times (mean over ranks), per mode."""
    median = statistics.median
    modes = {
        mode: {
            "step_s": median(per_step(results, mode, "step_s", max)),
            "engine_s": median(per_step(results, mode, "engine_s", max)),
            "blocked_s": median(per_step(results, mode, "blocked_s", statistics.fmean)),
            "in_flight_s": median(per_step(results, mode, "in_flight_s", statistics.fmean)),
            "waits": results[0]["records"][mode][0]["waits"],
        }
        for mode in MODES
    }
    seq = modes["sequential"]
    probe = results[0]["device_comm_s"]
    comm = median(probe) if probe else seq["blocked_s"]
    compute = seq["step_s"] - comm
    for values in modes.values():
        values["ratio"] = values["step_s"] / seq["step_s"]
        values["exposed_est_s"] = values["step_s"] - compute
    return {
        "config": asdict(cfg),
        "torch": torch.__version__,
        "comm_s": comm,
        "compute_s": compute,
        "limit": max(compute, comm) / (compute + comm),
        "host_waits_meaningful": probe is None,
        "modes": modes,
    }


def print_summary(summary: dict[str, Any]) -> None:
    """The human-readable table."""
    cfg = summary["config"]
    ms = lambda s: f"{1e3 * s:9.1f}"  # noqa: E731
    print(
        f"ranks={cfg['ranks']} ep={cfg['ep'] or cfg['ranks']} layers={cfg['layers']} hidden={cfg['hidden']} "
        f"ffn={cfg['ffn']} dense_ffn={cfg['dense_ffn']} experts={cfg['experts']} top_k={cfg['top_k']} "
        f"tokens={cfg['tokens']} microbatches={cfg['microbatches']} dispatcher={cfg['dispatcher']} "
        f"device={cfg['device']} torch={summary['torch']}; median of {cfg['steps']} steps after {cfg['warmup']}"
    )
    print(
        f"communication (sequential, nothing hidden) {ms(summary['comm_s'])} ms   compute {ms(summary['compute_s'])}"
        f" ms   limit max(compute, comm)/(compute + comm) = {summary['limit']:.3f}"
    )
    exposed_title = "exposed (waits)" if summary["host_waits_meaningful"] else "exposed (waits, host)"
    print(f"{'mode':<14} {'step ms':>9} {'ratio':>6} {exposed_title:>22} {'exposed (step-compute)':>23}")
    for mode, v in summary["modes"].items():
        print(f"{mode:<14} {ms(v['step_s'])} {v['ratio']:6.3f} {ms(v['blocked_s']):>22} {ms(v['exposed_est_s']):>23}")


def parse_args(argv: list[str] | None = None) -> tuple[Config, bool]:
    """The :class:`Config` and whether to print JSON."""
    defaults = Config()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("ranks", "layers", "hidden", "ffn", "dense_ffn", "experts", "top_k", "tokens", "microbatches",
                 "steps", "warmup", "threads", "seed"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    parser.add_argument("--ep", type=int, default=None, help="expert-parallel size (default: --ranks)")
    parser.add_argument("--dispatcher", default=defaults.dispatcher, choices=("alltoall", "allgather", "flex"))
    parser.add_argument("--device", default=defaults.device, choices=("cpu", "cuda"))
    parser.add_argument("--backend", default=None, help="gloo (default on CPU) or nccl (default on CUDA)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = vars(parser.parse_args(argv))
    as_json = args.pop("json")
    return Config(**args), as_json


def main(argv: list[str] | None = None) -> None:
    cfg, as_json = parse_args(argv)
    summary = summarise(launch(cfg), cfg)
    if as_json:
        print(json.dumps(summary, indent=2))
    else:
        print_summary(summary)


if __name__ == "__main__":
    main()
