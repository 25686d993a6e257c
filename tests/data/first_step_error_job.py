"""A training job whose batches cannot be split into micro-batches, found only at the first step.

    python -m tests.data.first_step_error_job

The loader yields whole batches (``batch_size=None``) of token lists, not tensors, so no check before the first
step can see the problem: splitting the first batch into ``num_microbatches=3`` fails alike on both ranks
(``devices=2``, CPU).
"""

from lightning.pytorch import Trainer
from torch.utils.data import DataLoader, IterableDataset

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo import MoEGPT


class TokenLists(IterableDataset):
    """Four batches of 8 sequences of 9 token ids, as Python lists."""

    def __iter__(self):  # noqa: ANN204
        for b in range(4):
            yield {"tokens": [[(b + i + j) % 32 for j in range(9)] for i in range(8)]}


class GPT(MoEGPT):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(TokenLists(), batch_size=None)


if __name__ == "__main__":
    trainer = Trainer(
        accelerator="cpu", devices=2, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        strategy=MoEOverlapStrategy(ep=2, num_microbatches=3, timeout=60),
    )
    trainer.fit(GPT(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_experts=4, ffn_hidden_size=16))
