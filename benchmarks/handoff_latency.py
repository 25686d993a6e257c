"""Hand-over latency of the overlap engine on this machine (CPU only; no process group needed).

Prints, in microseconds:
- one hand-over inside an ``F|B`` pair (``runtime.handoff()`` -> the other context runs -> back), including
  the per-context random-stream swap, and the swap alone;
- ``runtime.handoff()`` where it does not hand over (outside a schedule, and in a one-context phase);
- the engine's fixed cost per phase with two lanes kept for the step, against starting two threads per phase.

Usage: ``python benchmarks/handoff_latency.py [--handoffs 20000] [--microbatches 200]``
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable

import torch

from lightning_moe_overlap.overlap import CommRuntime, run_schedule
from lightning_moe_overlap.overlap.rng_snapshot import RngState


def best_of(repeats: int, fn: Callable[[], float]) -> float:
    return min(fn() for _ in range(repeats))


def pair_handoff_us(handoffs: int) -> float:
    """Per hand-over, in an F1|B0 pair where each context only hands over."""
    runtime = CommRuntime()
    spans: dict[str, float] = {}

    def work(name: str) -> str:
        start = time.perf_counter()
        for _ in range(handoffs):
            runtime.handoff()
        spans[name] = time.perf_counter() - start
        return name

    run_schedule(lambda i: work(f"F{i}"), lambda i, out: work(f"B{i}"), 2, runtime, overlap=True)
    # In the pair F1|B0 each round is two hand-overs (B->F and F->B); B0 starts first and F1 ends last.
    return max(spans["F1"], spans["B0"]) / (2 * handoffs) * 1e6


def lone_handoff_us(handoffs: int, in_schedule: bool) -> float:
    runtime = CommRuntime()
    spans: list[float] = []

    def work() -> None:
        start = time.perf_counter()
        for _ in range(handoffs):
            runtime.handoff()
        spans.append(time.perf_counter() - start)

    if in_schedule:
        run_schedule(lambda i: work(), lambda i, out: None, 1, runtime, overlap=True)
    else:
        work()
    return spans[0] / handoffs * 1e6


def rng_swap_us(repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        RngState.capture().restore()
    return (time.perf_counter() - start) / repeats * 1e6


def engine_phase_us(microbatches: int) -> float:
    """Fixed cost per phase of a step of empty tasks (lanes, baton, supervision), overlapped schedule."""
    start = time.perf_counter()
    run_schedule(lambda i: i, lambda i, out: None, microbatches, CommRuntime(), overlap=True)
    return (time.perf_counter() - start) / (microbatches + 1) * 1e6


def thread_pair_start_us(repeats: int) -> float:
    """The alternative: start and join two threads for every phase."""
    start = time.perf_counter()
    for _ in range(repeats):
        threads = [threading.Thread(target=lambda: None) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--handoffs", type=int, default=20000)
    parser.add_argument("--microbatches", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    n, r = args.handoffs, args.repeats
    rows = [
        ("hand-over in an F|B pair (incl. random-stream swap)", best_of(r, lambda: pair_handoff_us(n))),
        ("  of which: random-stream swap (capture + restore)", best_of(r, lambda: rng_swap_us(n))),
        ("runtime.handoff() outside a schedule", best_of(r, lambda: lone_handoff_us(n, in_schedule=False))),
        ("runtime.handoff() in a one-context phase", best_of(r, lambda: lone_handoff_us(n, in_schedule=True))),
        ("engine cost per phase (two lanes per step)", best_of(r, lambda: engine_phase_us(args.microbatches))),
        ("alternative: start + join two threads per phase", best_of(r, lambda: thread_pair_start_us(1000))),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"torch {torch.__version__}, best of {r}; microseconds")
    for name, value in rows:
        print(f"{name:<{width}}  {value:8.1f}")


if __name__ == "__main__":
    main()
