"""Activation memory and step time of the memory callbacks: no remedy, each callback, and both, in one run.

Trains this package's MoE GPT (expert-parallel experts, one process, ep=1: the comm points run, the all-to-alls
are local) with one model per configuration, steps interleaved (A B C ... A B C ...) so that drift on the machine
affects all alike. For each configuration it reports:

- ``held``: the activation memory after the forward of a micro-batch, i.e. the peak of a sequential step. On CPU
  it is measured by saved-tensor accounting (:class:`SavedActivationMeter`: distinct live storages autograd keeps
  for backward, the inputs checkpoints keep, parameters excluded); on CUDA it is
  ``torch.cuda.max_memory_allocated`` over the step minus the memory allocated before it.
- ``host``: bytes moved to host memory by the offload at that point.
- ``step``: median step time (forward, backward, optimizer) and its ratio to the run without any remedy.

Every configuration trains to the same parameters (the tests check it bit for bit); the script checks it too.

Usage: ``python benchmarks/memory.py [--layers 4] [--hidden 128] [--seq 256] [--batch 4] [--steps 5]
[--device cpu|cuda] [--threads 1] [--json]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from lightning.pytorch import Callback

from lightning_moe_overlap.callbacks import ActivationOffload, SavedActivationMeter, SelectiveRecompute
from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.moe.ep import apply_expert_parallel
from lightning_moe_overlap.overlap.runtime import CommRuntime

TAGS = ["dispatched_input", "pre_mlp_layernorm_output"]
OFFLOAD_MODULES = ["attn_norm", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act"]
A2A = ["a2a_overlap_attn", "a2a_overlap_post_attn", "a2a_overlap_mlp"]


def configurations(min_size: int) -> dict[str, Callable[[], list[Callback]]]:
    """Name -> the callbacks of that configuration (built fresh per model)."""
    return {
        "none": list,
        "recompute a2a_overlap_*": lambda: [SelectiveRecompute(modules=A2A)],
        "recompute core_attn+moe_act": lambda: [SelectiveRecompute(modules=["core_attn", "moe_act"])],
        "recompute full (uniform 1)": lambda: [SelectiveRecompute(granularity="full")],
        "offload tensors": lambda: [ActivationOffload(tensors=TAGS, min_tensor_size=min_size)],
        "offload modules": lambda: [ActivationOffload(modules=OFFLOAD_MODULES, min_tensor_size=min_size)],
        "both: recompute a2a_overlap_attn+moe_act, offload tensors": lambda: [
            SelectiveRecompute(modules=["a2a_overlap_attn", "moe_act"]),
            ActivationOffload(tensors=TAGS, min_tensor_size=min_size),
        ],
    }


@dataclass
class Result:
    name: str
    held_bytes: int = 0
    host_bytes: int = 0
    step_s: list[float] = field(default_factory=list)
    equal_to_none: bool = True

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)


class Run:
    """One model with one configuration's callbacks applied."""

    def __init__(self, args: argparse.Namespace, callbacks: list[Callback]) -> None:
        self.device = torch.device(args.device)
        self.model = MoEGPT(
            vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
            num_experts=args.experts, top_k=2, ffn_hidden_size=2 * args.hidden, seed=0,
        ).to(self.device)
        apply_expert_parallel(self.model, None, runtime=CommRuntime())
        for cb in callbacks:
            cb.apply(self.model)
        self.callbacks = callbacks
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-2)

    def step(self, tokens: torch.Tensor) -> tuple[float, int, int]:
        """One step; returns (seconds, activation bytes held after the forward, bytes on the host then)."""
        cuda = self.device.type == "cuda"
        self.opt.zero_grad()
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
        start = time.perf_counter()
        with SavedActivationMeter(self.model) as meter:
            loss = self.model._loss(tokens)
        held, host = meter.held_bytes(), meter.offloaded_bytes()
        loss.backward()
        self.opt.step()
        if cuda:
            torch.cuda.synchronize(self.device)
            held = torch.cuda.max_memory_allocated(self.device) - before
        return time.perf_counter() - start, held, host

    def close(self) -> list[torch.Tensor]:
        for cb in self.callbacks:
            cb.remove()  # type: ignore[attr-defined]
        return [p.detach().cpu() for p in self.model.parameters()]


def run(args: argparse.Namespace) -> list[Result]:
    configs = configurations(args.min_tensor_size)
    runs = {name: Run(args, make()) for name, make in configs.items()}
    results = {name: Result(name) for name in configs}
    g = torch.Generator().manual_seed(0)
    for step in range(args.steps + 1):  # step 0 warms up (lazy imports, allocator) and is not timed
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(args.device)
        for name, r in runs.items():
            seconds, held, host = r.step(tokens)
            res = results[name]
            res.held_bytes, res.host_bytes = held, host
            if step:
                res.step_s.append(seconds)
    reference = runs["none"].close()
    for name, r in runs.items():
        if name != "none":
            results[name].equal_to_none = all(torch.equal(a, b) for a, b in zip(r.close(), reference))
    return list(results.values())


def report(results: list[Result], args: argparse.Namespace) -> str:
    base = results[0]
    measure = "torch.cuda.max_memory_allocated" if args.device == "cuda" else "saved-tensor accounting"
    title = (
        f"MoE GPT: {args.layers} layers, hidden {args.hidden}, {args.experts} experts (top-2), batch {args.batch} x "
        f"seq {args.seq}, {args.device}; held activation memory by {measure}; {args.steps} timed steps"
    )
    header = f"{'configuration':<58} {'held MiB':>9} {'vs none':>8} {'host MiB':>9} {'step ms':>8} {'time x':>7}"
    lines = [title, f"{header} {'bitwise':>7}"]
    for r in results:
        lines.append(
            f"{r.name:<58} {r.held_bytes / 2**20:>9.2f} {r.held_bytes / base.held_bytes:>8.2f} "
            f"{r.host_bytes / 2**20:>9.2f} {1e3 * r.median_s:>8.1f} {r.median_s / base.median_s:>7.2f} "
            f"{'yes' if r.equal_to_none else 'NO':>7}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--min-tensor-size", type=int, default=0, help="ActivationOffload(min_tensor_size=...)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch.set_num_threads; 1 keeps CPU timings stable, 0 keeps torch's"
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = run(args)
    if args.json:
        print(json.dumps([{**asdict(r), "median_s": r.median_s} for r in results], indent=2))
    else:
        print(report(results, args))


if __name__ == "__main__":
    main()
