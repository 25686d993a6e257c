"""Checkpoints written in the background (``async_save=True``) on 2 gloo ranks: the steps go on while a save is
written, at most one save is in flight, what is written is what a synchronous save writes, and resumes are exact.

Oracles, all in one spawn:
- what ran: rank 1's file writes of each background save block until its training loop reports the next step
  (or the end of training), and record which released them: the saves of steps 2 and 4 are released by later
  steps, the last one by the end of training (a save that blocks its step would time out instead);
- a synchronous run of the same model and data (another code path: ``dcp.save`` on the calling thread): its
  checkpoints are bitwise the background run's, model and optimizer state, at every step that saved; a staged copy
  that aliased the live tensors would hold the later steps' values;
- the unbroken run (4 steps per epoch, 6 steps): runs resumed from the background save of step 2 (inside epoch 0,
  the data through ``ResumableDataLoader``) and from the epoch-end checkpoint of step 4 (``every_n_epochs=1``,
  saved in ``on_train_epoch_end``, with ``max_steps`` set) log each later step's epoch, batch index and loss
  bitwise as it did.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint import FileSystemWriter

from lightning_moe_overlap import MoEOverlapStrategy, ResumableDataLoader
from lightning_moe_overlap.checkpoint import load_consolidated_state_dict
from lightning_moe_overlap.checkpoint.sharded import read_all
from lightning_moe_overlap.demo import MoEGPT
from tests.helpers.data import RandomTokens
from tests.helpers.distributed import run_distributed

WORLD, BATCH, STEPS, PER_EPOCH, VOCAB = 2, 4, 6, 4, 32
SAVED = ("epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=1-step=6.ckpt")


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[tuple[int, int, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append((trainer.current_epoch, batch_idx, float(outputs["loss"])))


class HeldWrites(Callback):
    """Rank 1's file writes of a save wait until the loop has gone on past it: the next save starts, a later step
    starts, or training ends; each save records which let it go ("save", "step", "end", or "timeout" when nothing
    did within 60 s: what a save that holds up the loop gets)."""

    def __init__(self) -> None:
        self.progress = threading.Condition()
        self.saves: list[int] = []  # the step of each save, in order (the hook runs as the save starts)
        self.started = 0  # the last step whose batch started
        self.ended = False
        self.record: list[str] = []

    def write_data(self, original):
        def write_data(writer, plan, planner):
            with self.progress:
                index = len(self.record)
                step = self.saves[index]
                released = self.progress.wait_for(
                    lambda: len(self.saves) > index + 1 or self.started > step or self.ended, timeout=60
                )
                reason = "save" if len(self.saves) > index + 1 else "step" if self.started > step else "end"
                self.record.append(reason if released else "timeout")
            return original(writer, plan, planner)

        return write_data

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        with self.progress:
            self.saves.append(trainer.global_step)
            self.progress.notify_all()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        with self.progress:
            self.started = trainer.global_step + 1
            self.progress.notify_all()

    def on_train_end(self, trainer, pl_module) -> None:
        with self.progress:
            self.ended = True
            self.progress.notify_all()


def _fit(root: Path, world: int, *, background: bool, ckpt_path: Path | None = None, held: HeldWrites | None = None):
    torch.manual_seed(0)
    model = MoEGPT(vocab_size=VOCAB, hidden_size=16, num_layers=1, num_heads=2, num_experts=4, top_k=2,
                   ffn_hidden_size=8, seed=0)  # fmt: skip
    losses = Losses()
    steps = ModelCheckpoint(dirpath=root / "steps", every_n_train_steps=2, save_top_k=-1)
    epochs = ModelCheckpoint(dirpath=root / "epochs", every_n_epochs=1, save_top_k=-1)
    trainer = Trainer(
        accelerator="cpu", devices=world, max_steps=STEPS, logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=True,
        strategy=MoEOverlapStrategy(ep=2, num_microbatches=2, async_save=background),
        callbacks=[steps, epochs, losses, *([held] if held is not None else [])],
    )  # fmt: skip
    data = ResumableDataLoader(RandomTokens(WORLD * BATCH * PER_EPOCH, 9, VOCAB, seed=3), batch_size=BATCH)
    trainer.fit(model, train_dataloaders=data, ckpt_path=ckpt_path)
    return losses.losses


def _worker(rank: int, world: int, root: Path) -> dict:
    sync = _fit(root / "sync", world, background=False)
    held, original = HeldWrites(), FileSystemWriter.write_data
    if rank == 1:
        FileSystemWriter.write_data = held.write_data(original)
    background = _fit(root / "async", world, background=True, held=held)
    FileSystemWriter.write_data = original
    inside = _fit(root / "inside", world, background=True, ckpt_path=root / "async" / "steps" / SAVED[0])
    end = _fit(root / "end", world, background=True, ckpt_path=root / "async" / "epochs" / SAVED[1])
    return {"sync": sync, "async": background, "inside": inside, "end": end, "released": held.record}


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    state, _ = read_all(path)
    flat = {f"model.{k}": v for k, v in state["model"].items()}
    flat.update({f"optimizer.{k}": v for k, v in state["optimizer"].items() if torch.is_tensor(v)})
    return flat


def test_background_saves_run_beside_the_steps_and_write_what_a_synchronous_save_writes(tmp_path) -> None:
    ranks = run_distributed(_worker, WORLD, tmp_path, timeout_s=300)
    # saves at steps 2 (steps), 4 (steps, then epochs), 6 (steps, then epochs: the end of training stops epoch 1):
    # each returned before its files were written, the loop going on to the next save or step
    assert ranks[1]["released"] == ["step", "save", "step", "save", "end"], ranks[1]["released"]
    unbroken = ranks[0]["sync"]
    assert [(e, b) for e, b, _ in unbroken] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
    assert ranks[0]["async"] == unbroken
    for folder, name in (("steps", SAVED[0]), ("steps", SAVED[1]), ("epochs", SAVED[1]), ("steps", SAVED[2]),
                         ("epochs", SAVED[2])):  # fmt: skip
        assert not [p for p in (tmp_path / "async" / folder).iterdir() if ".partial-" in p.name]
        sync = _checkpoint(tmp_path / "sync" / folder / name)
        background = _checkpoint(tmp_path / "async" / folder / name)
        assert sync.keys() == background.keys() and len(sync) > 10
        assert [k for k in sync if not torch.equal(sync[k], background[k])] == [], name
        assert load_consolidated_state_dict(tmp_path / "async" / folder / name).keys()
    assert ranks[0]["inside"] == unbroken[2:]  # steps 3 to 6: epoch 0's batches 2 and 3, then epoch 1's
    assert ranks[0]["end"] == unbroken[4:]  # steps 5 and 6: epoch 1's batches 0 and 1
