"""Exposed gradient-sync time per step with the reduction at the end of the step and overlapped with the last
backward (``MoEOverlapStrategy(overlap_grad_reduce=...)``, docs/sharding.md).

Trains this package's MoE GPT (AdamW) under ``MoEOverlapStrategy(ep=..., shard=..., num_microbatches=...)`` on
gloo ranks, the flag off and on, fits interleaved (off, on, off, on, ...) so that drift affects both alike. The
exposed gradient-sync time of a step is measured the way ``benchmarks/overlap.py`` measures exposed all-to-all: the
time the step's thread is blocked in it, here the wall time of ``ShardedModel.end_step`` (flag off: every unit's
reduce-scatter; flag on: waiting for the reductions issued during the last backward, then the units left over and
FSDP's end-of-backward callback). Also the step time (``on_train_batch_start`` to ``on_train_batch_end``). Medians
over the steps after each fit's first, then over ranks (mean); ratios on/off.

Usage: ``python benchmarks/grad_reduce.py [--ranks 2] [--ep 1] [--shard full] [--microbatches 4] [--steps 6]
[--rounds 2] [--vocab 2048] [--hidden 128] [--layers 4] [--experts 8] [--ffn 256] [--json]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from collections.abc import Callable
from pathlib import Path

import torch

KEYS = ("exposed", "gather", "step")


@dataclass(frozen=True)
class Config:
    ranks: int = 2
    ep: int = 1
    shard: str = "full"
    microbatches: int = 4
    steps: int = 6
    rounds: int = 2
    vocab: int = 2048
    hidden: int = 128
    layers: int = 4
    experts: int = 8
    ffn: int = 256
    seq: int = 64


def run_fit(cfg: Config, early: bool) -> dict[str, list[float]]:
    """One fit (inside an initialised process group); this rank's per-step seconds: ``exposed`` (``end_step``),
    ``gather`` (``begin_step``), ``step``."""
    from lightning.pytorch import Callback, Trainer
    from torch.utils.data import DataLoader

    from lightning_moe_overlap import MoEOverlapStrategy
    from lightning_moe_overlap.demo import MoEGPT

    exposed: list[float] = []
    gather: list[float] = []
    steps: list[float] = []

    class Time(Callback):
        def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
            sharded = trainer.strategy.prepared.sharded
            for name, into in (("end_step", exposed), ("begin_step", gather)):
                setattr(sharded, name, _timed(getattr(sharded, name), into))

        def on_train_batch_start(self, *args) -> None:  # noqa: ANN002
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args) -> None:  # noqa: ANN002
            steps.append(time.perf_counter() - self.start)

    torch.manual_seed(0)
    model = MoEGPT(vocab_size=cfg.vocab, hidden_size=cfg.hidden, num_layers=cfg.layers, num_heads=4,
                   num_experts=cfg.experts, top_k=2, ffn_hidden_size=cfg.ffn, aux_loss_coeff=0.0, lr=1e-3)  # fmt: skip
    batch = 2 * cfg.microbatches
    rows = batch * cfg.ranks * cfg.steps
    tokens = torch.randint(0, cfg.vocab, (rows, cfg.seq), generator=torch.Generator().manual_seed(0))
    model.train_dataloader = lambda: DataLoader(tokens, batch_size=batch)
    trainer = Trainer(
        accelerator="cpu", devices=cfg.ranks, max_steps=cfg.steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[Time()],
        strategy=MoEOverlapStrategy(ep=cfg.ep, num_microbatches=cfg.microbatches, shard=cfg.shard,
                                    overlap_grad_reduce=early),
    )  # fmt: skip
    trainer.fit(model)
    # the first step builds the lanes and gathers for the first time
    return {"exposed": exposed[1:], "gather": gather[1:], "step": steps[1:]}


def _timed(fn: Callable[[], None], into: list[float]) -> Callable[[], None]:
    def timed() -> None:
        start = time.perf_counter()
        fn()
        into.append(time.perf_counter() - start)

    return timed


def worker(rank: int, world: int, cfg: Config) -> dict[str, dict[str, list[float]]]:
    torch.set_num_threads(1)
    out: dict[str, dict[str, list[float]]] = {name: {k: [] for k in KEYS} for name in ("off", "on")}
    for _ in range(cfg.rounds):
        for name, early in (("off", False), ("on", True)):
            for key, values in run_fit(cfg, early).items():
                out[name][key] += values
    return out


def summarise(per_rank: list[dict[str, dict[str, list[float]]]]) -> dict[str, float]:
    def median(mode: str, key: str) -> float:
        return statistics.fmean(statistics.median(r[mode][key]) for r in per_rank)

    summary = {}
    for key in KEYS:
        off, on = median("off", key), median("on", key)
        summary |= {f"{key}_off_ms": 1e3 * off, f"{key}_on_ms": 1e3 * on, f"{key}_ratio": on / off}
    return summary


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in asdict(Config()).items():
        parser.add_argument(f"--{name}", type=type(default), default=default)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    cfg = Config(**{k: getattr(args, k) for k in asdict(Config())})
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.helpers.distributed import run_distributed

    summary = summarise(run_distributed(worker, cfg.ranks, cfg, timeout_s=1200))
    if args.json:
        print(json.dumps({"config": asdict(cfg), **summary}))
    else:
        print(f"{cfg}")
        print("| overlap_grad_reduce | exposed grad sync ms/step | gather ms/step | step ms |")
        print("|---|---:|---:|---:|")
        for mode in ("off", "on"):
            print(f"| {mode} | " + " | ".join(f"{summary[f'{key}_{mode}_ms']:.1f}" for key in KEYS) + " |")
        print("| on / off | " + " | ".join(f"{summary[f'{key}_ratio']:.3f}" for key in KEYS) + " |")
    return summary


if __name__ == "__main__":
    main()
