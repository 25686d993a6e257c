"""The step time around a checkpoint save, synchronous vs in the background (``async_save=True``), in one run.

Two gloo processes train ``MoEGPT`` (ep=2) with a ``ModelCheckpoint`` every ``--every`` steps, once with each
mode, the same model, data and steps. Each rank records the wall time of every step from the start of its batch to
the start of the next (so a step's time includes the save its ``on_train_batch_end`` makes). Printed per mode: the
median step without a save, the median step that saves, their ratio, and the whole fit (saves included; the
background mode's last save is waited for at the end of ``fit``). Lower is better; the background mode's saving
step costs the copy of the rank's tensors to host memory, not the write.

    PYTHONPATH=. python benchmarks/async_save.py [--hidden 512] [--steps 12] [--every 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo import MoEGPT, SyntheticTokens


class StepClock(Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module) -> None:
        self.starts.append(time.perf_counter())


def _worker(rank: int, world: int, root: str, hidden: int, steps: int, every: int, background: bool) -> dict:
    model = MoEGPT(vocab_size=4096, hidden_size=hidden, num_layers=4, num_heads=8, num_experts=8, top_k=2,
                   ffn_hidden_size=2 * hidden, seed=0)  # fmt: skip
    clock = StepClock()
    trainer = Trainer(
        accelerator="cpu", devices=world, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        strategy=MoEOverlapStrategy(ep=2, async_save=background),
        callbacks=[clock, ModelCheckpoint(dirpath=Path(root) / str(background), every_n_train_steps=every,
                                          save_top_k=-1)],
    )  # fmt: skip
    begin = time.perf_counter()
    trainer.fit(model, datamodule=SyntheticTokens(vocab_size=4096, seq_len=64, batch_size=8, num_samples=4096))
    total = time.perf_counter() - begin
    durations = [b - a for a, b in zip(clock.starts, clock.starts[1:])]
    saving = [d for i, d in enumerate(durations) if (i + 1) % every == 0 and i + 1 < steps]  # the last: fit's end
    plain = [d for i, d in enumerate(durations) if (i + 1) % every != 0 and i > 0]  # the first step warms up
    params = sum(p.numel() for p in model.parameters() if not p.is_meta)
    return {"plain": statistics.median(plain), "saving": statistics.median(saving), "total": total, "params": params}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=4)
    args = parser.parse_args(argv)
    from tests.helpers.distributed import run_distributed

    rows = {}
    with tempfile.TemporaryDirectory() as root:
        for background in (False, True):
            ranks = run_distributed(_worker, 2, root, args.hidden, args.steps, args.every, background, timeout_s=1800)
            rows["background" if background else "synchronous"] = ranks[0]
    sync = rows["synchronous"]
    print(f"MoEGPT hidden {args.hidden}: {sync['params'] / 1e6:.1f} M parameters held per rank; a save every "
          f"{args.every} steps, {args.steps} steps, 2 processes (gloo)")  # fmt: skip
    print(f"{'mode':<12} {'step (s)':>9} {'saving step (s)':>16} {'saving / step':>14} {'fit (s)':>8} "
          f"{'fit / sync fit':>15}")  # fmt: skip
    for mode, row in rows.items():
        print(f"{mode:<12} {row['plain']:>9.3f} {row['saving']:>16.3f} {row['saving'] / row['plain']:>14.2f} "
              f"{row['total']:>8.2f} {row['total'] / sync['total']:>15.2f}")  # fmt: skip
    print(f"saving step, background / synchronous: {rows['background']['saving'] / sync['saving']:.2f}")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
