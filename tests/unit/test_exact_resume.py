"""Resumes that see every batch once, in one process with plain Lightning (the oracle: the unbroken run's own record
of each step's epoch, batch index, samples and loss).

- ``finish_saved_epoch`` (``_compat/lightning.py``): a checkpoint ``ModelCheckpoint(every_n_epochs=1)`` saves at an
  epoch's end, resumed with ``max_steps`` set, re-enters the finished epoch in Lightning 2.6 (a step on the next
  epoch's first batch labelled as the old epoch, then that batch again); closed by the rewrite, every later
  step is the unbroken run's.
- ``ResumableDataLoader``: a checkpoint saved inside an epoch resumes at the next batch of that epoch (a plain
  ``DataLoader`` starts the epoch again).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader, Dataset

from lightning_moe_overlap import ResumableDataLoader
from lightning_moe_overlap._compat import lightning as pl_compat

SAMPLES, BATCH = 16, 4  # 4 steps per epoch


class Indexed(Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        return torch.full((4,), float(i) / SAMPLES), torch.tensor(i)


class Recorder(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.steps: list[tuple[int, int, tuple[int, ...], str]] = []

    def training_step(self, batch, batch_idx):
        x, index = batch
        loss = (self.layer(x) ** 2).mean()
        self.steps.append((self.current_epoch, batch_idx, tuple(index.tolist()), loss.item().hex()))
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.1)


class ClosingStrategy(SingleDeviceStrategy):
    """Lightning's single-device strategy with the rewrite ``MoEOverlapStrategy.load_checkpoint`` applies."""

    def load_checkpoint(self, checkpoint_path, weights_only=None):
        return pl_compat.finish_saved_epoch(super().load_checkpoint(checkpoint_path, weights_only=weights_only))


def _fit(root: Path, loader_cls, *, every: dict, ckpt_path: Path | None = None, closing: bool = True):
    seed_everything(0)
    model = Recorder()
    trainer = Trainer(
        accelerator="cpu", max_steps=12, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=root, save_top_k=-1, **every)], deterministic=True,
        strategy=ClosingStrategy(torch.device("cpu")) if closing else SingleDeviceStrategy(torch.device("cpu")),
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=loader_cls(Indexed(), batch_size=BATCH), ckpt_path=ckpt_path)
    return model.steps


def test_an_epoch_end_checkpoint_resumes_at_the_next_epochs_first_batch(tmp_path) -> None:
    unbroken = _fit(tmp_path / "a", DataLoader, every={"every_n_epochs": 1})
    assert [(e, b) for e, b, _, _ in unbroken] == [(e, b) for e in range(3) for b in range(4)]
    saved = tmp_path / "a" / "epoch=0-step=4.ckpt"
    assert _fit(tmp_path / "b", DataLoader, every={"every_n_epochs": 1}, ckpt_path=saved) == unbroken[4:]
    # the state Lightning saved, restored as it is: the finished epoch again (what the rewrite closes)
    plain = _fit(tmp_path / "c", DataLoader, every={"every_n_epochs": 1}, ckpt_path=saved, closing=False)
    assert [(e, b) for e, b, _, _ in plain[:2]] == [(0, 4), (1, 0)] and plain[1][2] == plain[0][2]


def test_a_checkpoint_inside_an_epoch_resumes_at_its_next_batch(tmp_path) -> None:
    unbroken = _fit(tmp_path / "a", ResumableDataLoader, every={"every_n_train_steps": 3})
    for step in (3, 6):  # inside epoch 0, inside epoch 1
        saved = next((tmp_path / "a").glob(f"epoch=*-step={step}.ckpt"))
        resumed = _fit(tmp_path / f"r{step}", ResumableDataLoader, every={"every_n_train_steps": 3}, ckpt_path=saved)
        assert resumed == unbroken[step:], step
    plain_unbroken = _fit(tmp_path / "p", DataLoader, every={"every_n_train_steps": 3})
    assert plain_unbroken == unbroken  # the loader's class changes nothing of an unbroken run
    saved = tmp_path / "p" / "epoch=0-step=3.ckpt"
    plain = _fit(tmp_path / "q", DataLoader, every={"every_n_train_steps": 3}, ckpt_path=saved)
    assert plain[0][2] == unbroken[0][2]  # a plain DataLoader starts the epoch's batches again


def test_the_loader_state_round_trips_and_a_bad_state_is_refused() -> None:
    loader = ResumableDataLoader(Indexed(), batch_size=BATCH)
    batches = iter(loader)
    next(batches), next(batches)
    assert loader.state_dict() == {"batches": 2}
    fresh = ResumableDataLoader(Indexed(), batch_size=BATCH)
    fresh.load_state_dict(loader.state_dict())
    assert [b[1].tolist() for b in fresh] == [[8, 9, 10, 11], [12, 13, 14, 15]]
    assert len([b for b in fresh]) == 4  # the skip applies to one pass
    fresh.load_state_dict({"batches": 4})  # saved at the end of a pass: a fresh one
    assert len(list(fresh)) == 4
    with pytest.raises(ValueError, match=r"got \{'batches': -1\}.*expected \{'batches': n\} with n >= 0"):
        fresh.load_state_dict({"batches": -1})


def test_a_mid_epoch_state_is_left_as_it_is() -> None:
    checkpoint = {"loops": {"fit_loop": {
        "epoch_progress": {t: {"ready": 1, "started": 1, "processed": 0, "completed": 0} for t in ("total", "current")},
        "epoch_loop.batch_progress": {t: {"ready": 2, "started": 2, "processed": 2, "completed": 2}
                                      for t in ("total", "current")},
    }}}  # fmt: skip
    assert pl_compat.finish_saved_epoch(checkpoint) is checkpoint
    assert pl_compat.finish_saved_epoch({"state_dict": {}}) == {"state_dict": {}}
