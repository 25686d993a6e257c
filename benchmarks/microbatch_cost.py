"""What a micro-batch costs beyond its FLOPs: one step of ``M`` micro-batches against the whole batch in one call.

One process, the model of ``overlap.py`` (its defaults), expert parallelism of one rank (no communication: only
compute and the host work around it). Both runs do the same FLOPs; the difference is the cost of cutting the batch.
``torch.profiler`` splits each run's time into the GEMMs (``mm``, ``addmm``, ``bmm``, ``_grouped_mm``: their
efficiency falls with fewer rows per expert), the other ATen ops (their count grows with ``M``), and the rest of
the profiled run's wall time (Python, autograd's bookkeeping, the profiler's own cost). ``--repeats`` rounds of an
unprofiled and a profiled run each; medians.

Usage: ``python benchmarks/microbatch_cost.py [--microbatches 12] [--tokens 128] [--hidden 1024] [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from overlap import Config, Net

from lightning_moe_overlap.moe.ep import apply_expert_parallel
from lightning_moe_overlap.overlap.runtime import CommRuntime

GEMMS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::_grouped_mm", "aten::baddbmm"}


def measure(fn: Callable[[], None], repeats: int) -> dict[str, float]:
    """Medians over ``repeats`` rounds of an unprofiled run (wall ms) and a profiled one: GEMM ms, other ATen ms,
    the rest of the profiled run's wall time (Python, autograd, the profiler's own cost), and its ATen ops."""
    fn()
    rounds: dict[str, list[float]] = {"wall_ms": [], "gemm_ms": [], "other_ops_ms": [], "rest_ms": [], "ops": []}
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        rounds["wall_ms"].append(1e3 * (time.perf_counter() - start))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            fn()
            profiled = 1e3 * (time.perf_counter() - start)
        events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
        gemm = sum(e.self_cpu_time_total for e in events if e.key in GEMMS) / 1e3
        other = sum(e.self_cpu_time_total for e in events if e.key not in GEMMS) / 1e3
        rounds["gemm_ms"].append(gemm)
        rounds["other_ops_ms"].append(other)
        rounds["rest_ms"].append(profiled - gemm - other)
        rounds["ops"].append(sum(e.count for e in events))
    return {key: statistics.median(values) for key, values in rounds.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=Config.microbatches)
    parser.add_argument("--tokens", type=int, default=Config.tokens)
    parser.add_argument("--hidden", type=int, default=Config.hidden)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cfg = Config(hidden=args.hidden, tokens=args.tokens, microbatches=args.microbatches)
    net = Net(cfg)
    apply_expert_parallel(net, None, runtime=CommRuntime())
    x = torch.randn(cfg.microbatches, cfg.tokens, cfg.hidden)

    def micro() -> None:
        for i in range(cfg.microbatches):
            net(x[i]).square().mean().backward()

    def whole() -> None:
        net(x.reshape(-1, cfg.hidden)).square().mean().backward()

    runs = {"micro-batches": measure(micro, args.repeats), "whole batch": measure(whole, args.repeats)}
    print(f"layers={cfg.layers} hidden={cfg.hidden} experts={cfg.experts} top_k={cfg.top_k} "
          f"{cfg.microbatches} x {cfg.tokens} tokens, one process, one thread, torch {torch.__version__}")  # fmt: skip
    print(f"{'run':<14} {'wall ms':>8} {'GEMM ms':>8} {'other ops ms':>13} {'rest ms':>8} {'ATen ops':>9}")
    for name, v in runs.items():
        print(f"{name:<14} {v['wall_ms']:8.1f} {v['gemm_ms']:8.1f} {v['other_ops_ms']:13.1f} {v['rest_ms']:8.1f} "
              f"{v['ops']:9.0f}")  # fmt: skip
    a, b = runs["micro-batches"], runs["whole batch"]
    extra = cfg.microbatches - 1
    print(f"per extra micro-batch: {(a['wall_ms'] - b['wall_ms']) / extra:.2f} ms = GEMM "
          f"{(a['gemm_ms'] - b['gemm_ms']) / extra:.2f} + other ops {(a['other_ops_ms'] - b['other_ops_ms']) / extra:.2f}"
          f" + rest {(a['rest_ms'] - b['rest_ms']) / extra:.2f} ({(a['ops'] - b['ops']) / extra:.0f} ATen ops)")  # fmt: skip


if __name__ == "__main__":
    main()
