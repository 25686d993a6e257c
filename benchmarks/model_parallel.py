"""Step time and per-rank parameter bytes of tensor and context parallelism against the same model without them.

Trains this package's MoE GPT under ``MoEOverlapStrategy`` on ``--ranks`` gloo ranks in three layouts of the same
world: ``tp=1, cp=1`` (the baseline: ep over dp), ``tp=2`` (docs/tensor_parallel.md) and ``cp=2``
(docs/context_parallel.md), each with ``ep=--ep``, fits interleaved (baseline, tp, cp, baseline, ...) so that drift
affects all alike. Step time: ``on_train_batch_start`` to ``on_train_batch_end``, medians over the steps after each
fit's first, then the mean over ranks. Parameter bytes: what rank 0 holds after setup (local shards). The global
batch is the same in every layout: a tp or cp group reads one dp rank's samples, so the batch per dp rank grows by
tp (cp) where dp shrinks by it. Ratios to the baseline.

Usage: ``python benchmarks/model_parallel.py [--ranks 4] [--ep 2] [--microbatches 2] [--steps 5] [--rounds 2]
[--vocab 2048] [--hidden 128] [--layers 2] [--heads 4] [--experts 8] [--ffn 256] [--seq 128] [--json]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

LAYOUTS = {"baseline": {}, "tp2": {"tp": 2}, "cp2": {"cp": 2}}


@dataclass(frozen=True)
class Config:
    ranks: int = 4
    ep: int = 2
    microbatches: int = 2
    steps: int = 5
    rounds: int = 2
    vocab: int = 2048
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    experts: int = 8
    ffn: int = 256
    seq: int = 128


def run_fit(cfg: Config, layout: dict[str, int]) -> tuple[list[float], int]:
    """One fit (inside an initialised process group): this rank's step seconds and the bytes of its parameters."""
    from lightning.pytorch import Callback, Trainer
    from torch.utils.data import DataLoader

    from lightning_moe_overlap import MoEOverlapStrategy
    from lightning_moe_overlap.demo import MoEGPT
    from lightning_moe_overlap.parallel.dtensors import local

    steps: list[float] = []

    class Time(Callback):
        def on_train_batch_start(self, *args) -> None:  # noqa: ANN002
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args) -> None:  # noqa: ANN002
            steps.append(time.perf_counter() - self.start)

    torch.manual_seed(0)
    model = MoEGPT(vocab_size=cfg.vocab, hidden_size=cfg.hidden, num_layers=cfg.layers, num_heads=cfg.heads,
                   num_experts=cfg.experts, top_k=2, ffn_hidden_size=cfg.ffn, aux_loss_coeff=0.0, lr=1e-3)  # fmt: skip
    group = layout.get("tp", 1) * layout.get("cp", 1)  # ranks that read one dp rank's samples
    batch = 2 * cfg.microbatches * group
    rows = batch * (cfg.ranks // group) * cfg.steps
    tokens = torch.randint(0, cfg.vocab, (rows, cfg.seq + 1), generator=torch.Generator().manual_seed(0))
    model.train_dataloader = lambda: DataLoader(tokens, batch_size=batch)
    trainer = Trainer(
        accelerator="cpu", devices=cfg.ranks, max_steps=cfg.steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[Time()],
        strategy=MoEOverlapStrategy(ep=cfg.ep, num_microbatches=cfg.microbatches, **layout),
    )
    trainer.fit(model)
    held = sum(local(p).numel() * local(p).element_size() for p in model.parameters())
    return steps[1:], held  # the first step builds the lanes


def worker(rank: int, world: int, cfg: Config) -> dict[str, dict]:
    torch.set_num_threads(1)
    out: dict[str, dict] = {name: {"step": [], "bytes": 0} for name in LAYOUTS}
    for _ in range(cfg.rounds):
        for name, layout in LAYOUTS.items():
            seconds, held = run_fit(cfg, layout)
            out[name]["step"] += seconds
            out[name]["bytes"] = held
    return out


def summarise(per_rank: list[dict[str, dict]]) -> dict[str, float]:
    summary: dict[str, float] = {}
    for name in LAYOUTS:
        summary[f"{name}_step_ms"] = 1e3 * statistics.fmean(statistics.median(r[name]["step"]) for r in per_rank)
        summary[f"{name}_param_mib"] = per_rank[0][name]["bytes"] / 2**20
    for name in ("tp2", "cp2"):
        summary[f"{name}_step_ratio"] = summary[f"{name}_step_ms"] / summary["baseline_step_ms"]
        summary[f"{name}_param_ratio"] = summary[f"{name}_param_mib"] / summary["baseline_param_mib"]
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

    summary = summarise(run_distributed(worker, cfg.ranks, cfg, timeout_s=1800))
    if args.json:
        print(json.dumps({"config": asdict(cfg), **summary}))
    else:
        print(f"{cfg}")
        print("| layout | step ms | step / baseline | parameter MiB (rank 0) | / baseline |")
        print("|---|---:|---:|---:|---:|")
        for name in LAYOUTS:
            ratio = summary.get(f"{name}_step_ratio", 1.0)
            pratio = summary.get(f"{name}_param_ratio", 1.0)
            print(f"| {name} | {summary[f'{name}_step_ms']:.1f} | {ratio:.3f} | "
                  f"{summary[f'{name}_param_mib']:.2f} | {pratio:.3f} |")  # fmt: skip
    return summary


if __name__ == "__main__":
    main()
