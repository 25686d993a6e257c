"""Per-rank bytes of optimizer state on the device side and the host side under ``optimizer_cpu_offload``.

Trains this package's MoE GPT (AdamW) one step under ``MoEOverlapStrategy(ep=..., shard=mode,
optimizer_cpu_offload=True, optimizer_offload_fraction=f)`` on gloo ranks and, after the optimizer step, counts the
bytes of every optimizer state tensor by the side that holds it (``lightning_moe_overlap.optim.state_bytes``): the
state of the parameters updated on the device, that of the offloaded ones (in host memory), and the host copies of
the offloaded parameters and their gradients. On a CPU-only machine both sides are host memory: the split is what
the wrapper holds for each side; on CUDA the device side is GPU memory.

Usage: ``python benchmarks/optimizer_offload.py [--ranks 2] [--ep 2] [--vocab 2048] [--hidden 128] [--layers 4]
[--experts 8] [--ffn 256] [--json]``
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sharding_memory import Shape, build_model  # noqa: E402

MODES = ("none", "full")
FRACTIONS = (None, 0.25, 0.5, 0.75, 1.0)  # None: no offload


def run(mode: str, fraction: float | None, shape: Shape, *, ranks: int, ep: int) -> dict[str, int]:
    """Train one step (inside an initialised process group of ``ranks`` ranks); this rank's state bytes."""
    from lightning.pytorch import Callback, Trainer
    from torch.utils.data import DataLoader

    from lightning_moe_overlap import MoEOverlapStrategy
    from lightning_moe_overlap.optim import state_bytes

    measured: list[dict[str, int]] = []

    class Measure(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:  # noqa: ANN001, ANN002
            measured.append(asdict(state_bytes(trainer.optimizers[0])))

    model = build_model(shape)
    tokens = torch.randint(0, shape.vocab, (4 * ranks, 16), generator=torch.Generator().manual_seed(0))
    model.train_dataloader = lambda: DataLoader(tokens, batch_size=2)
    offload = {} if fraction is None else {"optimizer_cpu_offload": True, "optimizer_offload_fraction": fraction}
    trainer = Trainer(
        accelerator="cpu", devices=ranks, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Measure()],
        strategy=MoEOverlapStrategy(ep=ep, num_microbatches=2, shard=mode, **offload),
    )  # fmt: skip
    trainer.fit(model)
    return measured[-1]


def worker(rank: int, world: int, shape: Shape, ep: int) -> list[tuple[str, float | None, dict[str, int]]]:
    return [(mode, f, run(mode, f, shape, ranks=world, ep=ep)) for mode in MODES for f in FRACTIONS]


def table(rows: list[tuple[str, float | None, dict[str, int]]]) -> str:
    mib = 1 << 20
    lines = [
        "| shard | fraction | device state MiB | host state MiB | host copies MiB | device state / no offload |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    plain = {mode: held["device"] for mode, f, held in rows if f is None}
    for mode, f, held in rows:
        lines.append(
            f"| `{mode}` | {'off' if f is None else f} | {held['device'] / mib:.3f} | {held['host'] / mib:.3f} "
            f"| {held['host_copies'] / mib:.3f} | {held['device'] / plain[mode]:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--ep", type=int, default=2)
    for name, default in asdict(Shape()).items():
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    shape = Shape(**{k: getattr(args, k) for k in asdict(Shape())})
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.helpers.distributed import run_distributed

    per_rank = run_distributed(worker, args.ranks, shape, args.ep, timeout_s=300)
    if args.json:
        print(json.dumps(per_rank))
    else:
        print(f"MoE GPT {shape}, AdamW, {args.ranks} ranks, ep={args.ep}; rank 0:")
        print(table(per_rank[0]))
    return per_rank


if __name__ == "__main__":
    main()
