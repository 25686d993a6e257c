"""ATen ops and host reads per MoE layer and micro-batch, per dispatch path, and their time side by side.

Kernel launches cannot be counted without a GPU; the ATen ops an MoE layer dispatches are their proxy on CPU (each
op is at least one launch on CUDA, views aside). One process stands for ``--ep`` ranks: every all-to-all is a
loopback (``moe/dispatch/loopback.py``), so each dispatch path runs all of its stages. Per path, one forward and
one backward of a :class:`MoELayer` are counted under a ``TorchDispatchMode`` (views and metadata ops listed apart),
with the host reads (``tolist``, ``item``, ``int()`` / ``bool()`` of a tensor, seen by a ``TorchFunctionMode``; and
``_local_scalar_dense``), then ``--repeats`` rounds time a forward + backward of each path in turn (interleaved,
medians): ratios to ``plain``.

Paths: ``plain`` (the default; one process holds every expert, so the rows are regrouped by expert and run one
grouped GEMM, the CUDA layout), ``static`` (``static=True``: fixed slots, no host read), ``dedup`` (``dedup=True``),
``allgather``.

Usage: ``python benchmarks/moe_ops.py [--hidden 1024] [--tokens 128] [--experts 8] [--top-k 2] [--repeats 20]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_moe_overlap.moe import MoELayer, apply_expert_parallel
from lightning_moe_overlap.moe.dispatch.loopback import Loopback
from lightning_moe_overlap.overlap.runtime import CommRuntime

PATHS = ("plain", "static", "dedup", "allgather")
READ_METHODS = ("tolist", "item", "__int__", "__bool__", "__float__")
HOST_READS = {"_local_scalar_dense"}  # what `tolist`, `item` and `int()` of a tensor dispatch
VIEWS = {"view", "_unsafe_view", "reshape", "expand", "t", "transpose", "slice", "select", "unsqueeze", "squeeze",
         "permute", "alias", "detach", "split", "chunk", "split_with_sizes", "as_strided", "unbind"}  # fmt: skip


class OpCounter(TorchDispatchMode):
    """Counts every ATen op by name (its overload packet)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[func._overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def summary(self, reads: ReadCounter) -> dict[str, int]:
        views = sum(n for name, n in self.ops.items() if name in VIEWS)
        scalars = sum(n for name, n in self.ops.items() if name in HOST_READS)
        return {"ops": sum(self.ops.values()) - views, "views": views, "host_reads": reads.reads + scalars}


class ReadCounter(TorchFunctionMode):
    """Counts the tensor methods that read a value back to the host (a CUDA sync; on CPU only a dispatch op when
    the value is a scalar)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if getattr(func, "__name__", "") in READ_METHODS:
            self.reads += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counted() -> Iterator[tuple[OpCounter, ReadCounter]]:
    with ReadCounter() as reads, OpCounter() as ops:
        yield ops, reads


def build(path: str, base: MoELayer) -> MoELayer:
    """``base`` made expert-parallel on one process, whose all-to-alls are loopbacks (every stage runs)."""
    layer = copy.deepcopy(base)
    runtime = CommRuntime(communicator=Loopback(0.0, torch.device("cpu")))
    name = "allgather" if path == "allgather" else "alltoall"
    knobs = {"static": path == "static", "dedup": path == "dedup"} if name == "alltoall" else {}
    apply_expert_parallel(layer, None, dispatcher=name, runtime=runtime, **knobs)
    return layer


def count(path: str, layer: MoELayer, x: torch.Tensor) -> dict[str, dict[str, int]]:
    """Ops of one forward and of its backward."""
    x = x.clone().requires_grad_()
    with counted() as (forward, forward_reads):
        loss = layer(x).float().square().mean()
    with counted() as (backward, backward_reads):
        loss.backward()
    return {"forward": forward.summary(forward_reads), "backward": backward.summary(backward_reads)}


def timed(layer: MoELayer, x: torch.Tensor) -> Callable[[], float]:
    def run() -> float:
        start = time.perf_counter()
        layer(x.clone().requires_grad_()).float().square().mean().backward()
        return time.perf_counter() - start

    return run


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=32)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--capacity-factor", type=float, default=None, help="None: dropless")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    base = MoELayer(args.hidden, args.ffn, args.experts, args.top_k, capacity_factor=args.capacity_factor).to(dtype)
    x = torch.randn(args.tokens, args.hidden, dtype=dtype)
    layers = {path: build(path, base) for path in PATHS}
    counts = {path: count(path, layer, x) for path, layer in layers.items()}
    runs = {path: timed(layer, x) for path, layer in layers.items()}
    for run in runs.values():  # warm-up
        run()
    times: dict[str, list[float]] = {path: [] for path in PATHS}
    for _ in range(args.repeats):
        for path, run in runs.items():
            times[path].append(run())
    medians = {path: statistics.median(values) for path, values in times.items()}
    result = {
        "config": vars(args),
        "torch": torch.__version__,
        "paths": {
            path: {**counts[path], "ms": 1e3 * medians[path], "ratio": medians[path] / medians["plain"]}
            for path in PATHS
        },
    }
    if args.json:
        print(json.dumps(result))
        return result
    print(f"MoE layer: hidden={args.hidden} ffn={args.ffn} experts={args.experts} top_k={args.top_k} "
          f"tokens={args.tokens} capacity_factor={args.capacity_factor} dtype={args.dtype} torch={torch.__version__}; "
          f"ATen ops per forward / backward (views apart), host reads, median of {args.repeats} fwd+bwd")  # fmt: skip
    print(f"{'path':<18} {'fwd ops':>8} {'bwd ops':>8} {'views':>6} {'host reads':>11} {'ms':>8} {'ratio':>6}")
    for path, v in result["paths"].items():
        f, b = v["forward"], v["backward"]
        print(f"{path:<18} {f['ops']:8d} {b['ops']:8d} {f['views'] + b['views']:6d} "
              f"{f['host_reads'] + b['host_reads']:11d} {v['ms']:8.2f} {v['ratio']:6.3f}")  # fmt: skip
    return result


if __name__ == "__main__":
    main()
