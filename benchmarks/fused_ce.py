"""The loss step (LM head + cross-entropy, forward and backward) fused vs unfused: peak memory and time, side by side.

The unfused step is ``F.cross_entropy(F.linear(hidden, weight).float(), target)`` then ``backward()``: the
``[tokens, vocab]`` logits, their log-softmax and their gradient all exist at once. The fused one is
``fused_linear_cross_entropy`` (``lightning_moe_overlap/loss``): ``[chunk, chunk]`` blocks of logits, never more.
The default shape is the seed's example (129,280 vocabulary) at a hidden size of 64 with 4,096 tokens, which a
CPU's host memory holds unfused; ``--variants fused --tokens 16384`` runs the fused step alone at the seed's 16k
tokens.

- **peak memory above the inputs** (and their gradients' buffers): each variant in a fresh process (``--variant``),
  so one's allocations do not sit in the other's peak, one loss step; on CPU the process's peak resident set
  (``VmHWM``) is reset (``/proc/self/clear_refs``) once the inputs exist and read after the step (Linux's
  accounting: an upper bound of the tensor bytes, the allocator's slack included); on CUDA
  ``torch.cuda.max_memory_allocated`` minus the bytes allocated before the step;
- **time**: in this process afterwards, the variants' loss steps interleaved (fused, unfused, fused, ...) after one
  warm-up step each, the median of ``--repeat`` each, so a machine whose load drifts slows both alike;
- next to them, the bytes one ``[tokens, vocab]`` float32 logits tensor takes, and the fused/unfused ratios.

Usage: ``python benchmarks/fused_ce.py [--tokens 4096] [--vocab 129280] [--hidden 64] [--chunk 3072]
[--dtype float32|bfloat16] [--device cpu|cuda] [--repeat 3] [--variants fused unfused] [--json]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SELF = Path("/proc/self")
MIB = 2**20


def _status_kib(field: str) -> int:
    for line in (SELF / "status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class PeakMemory:
    """Peak bytes above the moment of :meth:`start`: host resident set on CPU, the allocator's count on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cpu" and not (SELF / "clear_refs").exists():
            raise RuntimeError("benchmarks/fused_ce.py measures host memory through /proc (Linux); run it on Linux.")
        self.base = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            (SELF / "clear_refs").write_text("5")  # VmHWM := VmRSS
            self.base = _status_kib("VmRSS") * 1024

    def peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.base
        return _status_kib("VmHWM") * 1024 - self.base


def loss_step(variant: str, h: torch.Tensor, w: torch.Tensor, target: torch.Tensor, chunk: int) -> float:
    """One forward and backward of the loss (gradients accumulated into the existing ``.grad``); its value."""
    if variant == "fused":
        from lightning_moe_overlap.loss import fused_linear_cross_entropy  # imported before the peak counter starts

        loss = fused_linear_cross_entropy(h, w, target, chunk_size=chunk)
    else:
        loss = F.cross_entropy(F.linear(h, w).float(), target)
    loss.backward()
    return float(loss.detach())


def inputs(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden ``[T, D]``, weight ``[V, D]`` (with zeroed ``.grad`` buffers: their bytes are not the loss's), target."""
    torch.manual_seed(0)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    h = torch.randn(args.tokens, args.hidden, device=device).to(dtype).requires_grad_()
    w = (torch.randn(args.vocab, args.hidden, device=device) * args.hidden**-0.5).to(dtype).requires_grad_()
    target = torch.randint(0, args.vocab, (args.tokens,), device=device)
    h.grad, w.grad = torch.zeros_like(h), torch.zeros_like(w)
    return h, w, target


def run_variant(args: argparse.Namespace) -> dict:
    """This process: the inputs, then one loss step of ``args.variant`` under the peak counter."""
    import lightning_moe_overlap.loss  # noqa: F401 - its import's memory is not the loss step's

    h, w, target = inputs(args)
    memory = PeakMemory(torch.device(args.device))
    memory.start()
    loss = loss_step(args.variant, h, w, target, args.chunk)
    return {"variant": args.variant, "peak_mib": memory.peak() / MIB, "loss": loss}


def step_times(args: argparse.Namespace, variants: list[str]) -> dict[str, float]:
    """The median seconds of one loss step per variant, the variants interleaved, after a warm-up step each."""
    h, w, target = inputs(args)
    device = torch.device(args.device)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.repeat + 1):
        for variant in variants:
            start = time.perf_counter()
            loss_step(variant, h, w, target, args.chunk)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[variant].append(time.perf_counter() - start)
    return {v: statistics.median(t[1:]) for v, t in times.items()}


def table(args: argparse.Namespace, rows: dict[str, dict]) -> str:
    logits_mib = args.tokens * args.vocab * 4 / MIB
    lines = [
        f"loss step, {args.tokens} tokens x {args.vocab} vocab, hidden {args.hidden}, {args.dtype}, chunk "
        f"{args.chunk}, {args.device}; one float32 [tokens, vocab] logits tensor: {logits_mib:.0f} MiB",
        f"{'variant':<10}{'peak MiB':>12}{'step s':>10}{'loss':>12}",
        *(f"{r['variant']:<10}{r['peak_mib']:>12.0f}{r['step_s']:>10.3f}{r['loss']:>12.6f}" for r in rows.values()),
    ]
    if {"fused", "unfused"} <= rows.keys():
        fused, unfused = rows["fused"], rows["unfused"]
        lines.append(
            f"fused / unfused: peak {fused['peak_mib'] / unfused['peak_mib']:.3f}, time "
            f"{fused['step_s'] / unfused['step_s']:.2f}; unfused peak = {unfused['peak_mib'] / logits_mib:.1f} x logits"
        )
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=129_280)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=3072)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--variants", nargs="+", choices=["fused", "unfused"], default=["fused", "unfused"])
    parser.add_argument("--variant", choices=["fused", "unfused"], help=argparse.SUPPRESS)  # a child process
    parser.add_argument("--json", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package
    if args.variant is not None:
        result = run_variant(args)
        print(json.dumps(result))
        return result
    rows = {}
    for variant in args.variants:
        child = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--json"]
        out = subprocess.run(
            [sys.executable, __file__, *child, "--variant", variant], capture_output=True, text=True, check=True
        )
        rows[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    for variant, seconds in step_times(args, args.variants).items():
        rows[variant]["step_s"] = seconds
    print(json.dumps({"args": vars(args), "rows": rows}) if args.json else table(args, rows))
    return rows


if __name__ == "__main__":
    main()
