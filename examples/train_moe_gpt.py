"""Train a small MoE GPT with expert parallelism and all-to-all overlap on CPU (4 gloo processes, ~1 minute).

    python examples/train_moe_gpt.py                 # ep=2 x dp=4, overlap on, delayed wgrad
    python examples/train_moe_gpt.py --no-overlap    # the same run, micro-batches sequential

Lightning re-runs this script once per extra process (the strategy's default ``start_method="popen"``).
"""

from __future__ import annotations

import argparse

import torch
from lightning.pytorch import Trainer, seed_everything

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo import MoEGPT, SyntheticTokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--no-overlap", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(1)  # several processes share the CPU cores
    seed_everything(0)
    strategy = MoEOverlapStrategy(
        ep=args.ep, overlap=not args.no_overlap, delay_wgrad=not args.no_overlap, num_microbatches=2
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        log_every_n_steps=10,
        limit_val_batches=2,
        val_check_interval=20,
        enable_checkpointing=False,
        logger=False,
    )
    model = MoEGPT(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_experts=8, top_k=2)
    trainer.fit(model, datamodule=SyntheticTokens(vocab_size=128, seq_len=32, batch_size=8))
    if trainer.is_global_zero:
        print(f"final train_loss={float(trainer.callback_metrics['train_loss']):.4f} "
              f"val_loss={float(trainer.callback_metrics['val_loss']):.4f} steps={trainer.global_step}")


if __name__ == "__main__":
    main()
