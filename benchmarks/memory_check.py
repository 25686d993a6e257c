"""``check``'s memory estimate next to what a real run holds, per category, for three layouts on gloo ranks.

Trains this package's MoE GPT (AdamW) a few steps under ``MoEOverlapStrategy`` on CPU and measures, on the first
process of each pp rank:

- ``params``: the distinct storages of the module's and the optimizer's parameters while the step runs (the shards
  and the gathered copies), against ``check``'s ``params + gathered``;
- ``grads``: the distinct storages of the gradients just before the step's reduction (``ShardedModel.end_step``),
  unsharded in the gathered parameters, against ``grads``;
- ``optim``: every tensor of the optimizer's state after the step, against ``optim``;
- ``activ``: the peak over the step of the distinct live storages autograd saved for backward (pack hooks installed
  around every forward and loss, in whichever thread runs it; parameters excluded), against ``activ``.

Layouts: ``pp=1 ep=2`` (2 ranks, overlap, 2 micro-batches); ``ep=2 shard=full`` (4 ranks: dp 4, edp 2);
``pp=2 vpp=2 ep=2`` (4 ranks, interleaved 1F1B, 4 micro-batches).

Usage: ``python benchmarks/memory_check.py [--steps 2] [--json]``
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

SIZES = {"vocab_size": 256, "hidden_size": 64, "num_layers": 4, "num_heads": 4, "num_experts": 8, "top_k": 2,
         "ffn_hidden_size": 128}  # fmt: skip
MICRO_BATCH, SEQ = 4, 64
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "pp=1 ep=2": (2, {"ep": 2, "num_microbatches": 2}),
    "ep=2 shard=full": (4, {"ep": 2, "shard": "full", "num_microbatches": 2}),
    "pp=2 vpp=2 ep=2": (4, {"ep": 2, "pp": 2, "vpp": 2, "num_microbatches": 4}),
}
CATEGORIES = ("params", "grads", "optim", "activ")


@dataclass
class Row:
    layout: str
    pp_rank: int
    measured: dict[str, int]
    estimate: dict[str, int]


class SavedPeak:
    """The peak of the distinct live storages autograd saves, across threads (a lock; each thread's hooks)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, references]
        self.excluded: set[int] = set()
        self.peak = 0
        self.total = 0

    def pack(self, t: Tensor) -> Any:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.excluded or t.device.type == "meta":
            return t
        with self.lock:
            entry = self.live.setdefault(ptr, [storage.nbytes(), 0])
            if entry[1] == 0:
                self.total += entry[0]
                self.peak = max(self.peak, self.total)
            entry[1] += 1
        return _Held(t, ptr, self)

    def release(self, ptr: int) -> None:
        with self.lock:
            entry = self.live[ptr]
            entry[1] -= 1
            if entry[1] == 0:
                self.total -= entry[0]
                del self.live[ptr]


class _Held:
    def __init__(self, t: Tensor, ptr: int, meter: SavedPeak) -> None:
        self.t, self.ptr, self.meter = t, ptr, meter

    def __del__(self) -> None:
        self.meter.release(self.ptr)


def _unpack(h: Any) -> Tensor:
    return h.t if isinstance(h, _Held) else h


def _storages(tensors: list[Tensor]) -> int:
    from lightning_moe_overlap.parallel.dtensors import local

    seen: dict[int, int] = {}
    for t in tensors:
        s = local(t).untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def worker(rank: int, world: int, layout: str, steps: int) -> tuple[int, dict[str, int]]:
    from lightning.pytorch import Callback, Trainer
    from torch.utils.data import DataLoader

    from lightning_moe_overlap import MoEOverlapStrategy
    from lightning_moe_overlap.demo import MoEGPT
    from lightning_moe_overlap.parallel.dtensors import local
    from lightning_moe_overlap.parallelize import sharding

    _, strategy_args = LAYOUTS[layout]
    meter = SavedPeak()
    found: dict[str, int] = {"params": 0, "grads": 0, "optim": 0}
    holder: dict[str, Any] = {}

    def exclude_params() -> None:
        model = holder["model"]
        opt_params = [p for g in holder["opt"].param_groups for p in g["params"]] if "opt" in holder else []
        meter.excluded = {local(p).untyped_storage().data_ptr() for p in [*model.parameters(), *opt_params]
                          if not p.is_meta}  # fmt: skip

    def with_hooks(fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            exclude_params()
            with torch.autograd.graph.saved_tensors_hooks(meter.pack, _unpack):
                return fn(*args, **kwargs)

        return run

    class Measured(MoEGPT):
        def _loss(self, batch: Any) -> Tensor:
            return with_hooks(super()._loss)(batch)

        def configure_pipeline(self, layout: Any) -> Any:
            from dataclasses import replace

            chunks = super().configure_pipeline(layout)
            for chunk in chunks.modules:
                chunk.forward = with_hooks(chunk.forward)
            return replace(chunks, loss_fn=with_hooks(chunks.loss_fn))

    end_step = sharding.ShardedModel.end_step

    def measured_end_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        model = holder["model"]
        params = [p for p in model.parameters() if not p.is_meta]
        owned = [p for g in holder["opt"].param_groups for p in g["params"] if not p.is_meta]
        found["params"] = max(found["params"], _storages([*params, *owned]))
        found["grads"] = max(found["grads"], _storages([p.grad for p in params if p.grad is not None]))
        return end_step(self, *args, **kwargs)

    sharding.ShardedModel.end_step = measured_end_step  # type: ignore[method-assign]

    class Measure(Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            holder["opt"] = trainer.optimizers[0]

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            state = [v for s in trainer.optimizers[0].state.values() for v in s.values() if isinstance(v, Tensor)]
            found["optim"] = max(found["optim"], _storages(state))

    model = Measured(**SIZES, aux_loss_coeff=0.0)
    holder["model"] = model
    m = strategy_args["num_microbatches"]
    tokens = torch.randint(0, SIZES["vocab_size"], (MICRO_BATCH * m * world * steps, SEQ + 1),
                           generator=torch.Generator().manual_seed(0))  # fmt: skip
    model.train_dataloader = lambda: DataLoader(tokens, batch_size=MICRO_BATCH * m)
    trainer = Trainer(
        accelerator="cpu", devices=world, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Measure()], limit_val_batches=0,
        strategy=MoEOverlapStrategy(**strategy_args),
    )  # fmt: skip
    trainer.fit(model)
    sharding.ShardedModel.end_step = end_step  # type: ignore[method-assign]
    pp = strategy_args.get("pp", 1)
    return rank // (world // pp), {**found, "activ": meter.peak}


def estimates(layout: str) -> list[dict[str, int]]:
    """``check``'s rows for ``layout`` (the same model and data sizes), one per pp rank."""
    from lightning_moe_overlap.cli.check import _split
    from lightning_moe_overlap.cli.memory import MemorySettings, estimate_memory
    from lightning_moe_overlap.config import OverlapConfig
    from lightning_moe_overlap.demo import MoEGPT

    world, strategy_args = LAYOUTS[layout]
    cfg = OverlapConfig(**{"overlap": None, **strategy_args})
    with torch.device("meta"):
        model = MoEGPT(**SIZES, aux_loss_coeff=0.0)
    split = _split(cfg, model) if cfg.pp > 1 else None
    rows, _ = estimate_memory(model, cfg, MemorySettings(world, micro_batch=MICRO_BATCH, seq_len=SEQ), split)
    return [{"params": r.held.params + r.held.gathered, "grads": r.held.grads, "optim": r.held.optimizer,
             "activ": r.activations or 0} for r in rows]  # fmt: skip


def table(rows: list[Row]) -> str:
    kib = 1 << 10
    lines = ["| layout | pp rank | " + " | ".join(f"{c} KiB (check / measured)" for c in CATEGORIES) + " |",
             "|---|---:|" + "---:|" * len(CATEGORIES)]  # fmt: skip
    for r in rows:
        cells = [f"{r.estimate[c] / kib:.0f} / {r.measured[c] / kib:.0f} = {r.estimate[c] / r.measured[c]:.3f}"
                 for c in CATEGORIES]  # fmt: skip
        lines.append(f"| `{r.layout}` | {r.pp_rank} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.helpers.distributed import run_distributed

    rows = []
    for layout in args.layouts:
        world, _ = LAYOUTS[layout]
        per_rank = run_distributed(worker, world, layout, args.steps, timeout_s=600)
        first = {}
        for pp_rank, found in per_rank:
            first.setdefault(pp_rank, found)
        rows += [Row(layout, pp_rank, first[pp_rank], estimate) for pp_rank, estimate in enumerate(estimates(layout))]
    print(json.dumps([asdict(r) for r in rows]) if args.json else table(rows))
    return rows


if __name__ == "__main__":
    main()
