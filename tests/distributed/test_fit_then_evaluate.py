"""``fit`` -> ``validate`` -> ``test`` -> ``predict`` -> ``fit`` again on one model, with the same Trainer and with a new
one: ``MoEGPT(num_experts=8)``, ``MoEOverlapStrategy(ep=2, num_microbatches=2)``, 2 gloo ranks.

Every later run sets the strategy up again on the model the first ``fit`` made expert-parallel. Oracle, per rank: a
plain ``MoEGPT`` in this process with no strategy (all 8 experts, no process group), loaded with the trained
weights (``full_state_dict``), evaluated on exactly the batches each run saw: the validation and test losses (each
batch's, and the reduced metric), the predictions, and the first training loss of the next ``fit``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo import MoEGPT, _PatternTokens
from tests.helpers.distributed import run_distributed

WORLD, MICRO, BATCH = 2, 2, 4
GPT = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_experts=8, top_k=2, ffn_hidden_size=16)


class Recorded(MoEGPT):
    """The demo model; each step records the batch it got and the loss it computed."""

    def __init__(self) -> None:
        super().__init__(**GPT, lr=1e-2)
        self.seen: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {"train": [], "val": [], "test": []}

    def _record(self, kind: str, batch: torch.Tensor) -> torch.Tensor:
        loss = self._loss(batch)
        self.seen[kind].append((batch.detach().clone(), loss.detach().clone()))
        return loss

    def training_step(self, batch, batch_idx):
        return self._record("train", batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._record("val", batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._record("test", batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        self.seen.setdefault("predict", []).append((batch.detach().clone(), batch))
        return self(batch)


def _loader(seed: int, n: int = 16) -> DataLoader:
    return DataLoader(_PatternTokens(n, 8, 64, seed=seed), batch_size=BATCH, drop_last=True)


def _trainer(max_steps: int = 2) -> Trainer:
    return Trainer(
        accelerator="cpu", devices=WORLD, max_steps=max_steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        strategy=MoEOverlapStrategy(ep=2, num_microbatches=MICRO),
    )


def _plain(trainer: Trainer) -> MoEGPT:
    """A plain model with the trained weights (collective: ``full_state_dict`` gathers them on rank 0)."""
    holder = [trainer.strategy.full_state_dict()]
    dist.broadcast_object_list(holder, src=0)
    plain = MoEGPT(**GPT)
    plain.load_state_dict(holder[0])
    return plain.eval()


def _check_eval(kind: str, model: Recorded, plain: MoEGPT, metric: float) -> int:
    """Each batch's loss equals the plain model's; the reduced metric is the mean of the plain losses of all ranks."""
    seen, model.seen[kind] = model.seen[kind], []
    assert seen, kind
    with torch.no_grad():
        expected = [plain._loss(batch) for batch, _ in seen]
    for (_, loss), want in zip(seen, expected):
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5, msg=f"rank {dist.get_rank()} {kind}")
    mean = torch.stack(expected).mean().reshape(1)
    dist.all_reduce(mean)
    torch.testing.assert_close(torch.tensor(metric), mean[0] / WORLD, rtol=1e-5, atol=1e-5)
    return len(seen)


def _check_next_fit(model: Recorded, plain: MoEGPT) -> None:
    """The first micro-batch of a later ``fit`` runs on the weights the earlier runs left (the plain model's)."""
    batch, loss = model.seen["train"][0]
    with torch.no_grad():
        torch.testing.assert_close(loss, plain._loss(batch), rtol=1e-5, atol=1e-5)
    model.seen["train"] = []


def _runs(trainer: Trainer, model: Recorded, plain: MoEGPT) -> dict:
    checked = {}
    val = trainer.validate(model, dataloaders=_loader(1), verbose=False)[0]["val_loss"]
    checked["val"] = _check_eval("val", model, plain, val)
    test = trainer.test(model, dataloaders=_loader(2), verbose=False)[0]["test_loss"]
    checked["test"] = _check_eval("test", model, plain, test)
    predictions = trainer.predict(model, dataloaders=_loader(3, n=8))
    seen, model.seen["predict"] = model.seen["predict"], []
    assert predictions and len(predictions) == len(seen)
    for got, (batch, _) in zip(predictions, seen):
        with torch.no_grad():
            torch.testing.assert_close(got, plain(batch), rtol=1e-5, atol=1e-5)
    checked["predict"] = len(predictions)
    return checked


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    model, first = Recorded(), _trainer()
    first.fit(model, train_dataloaders=_loader(0))
    model.seen["train"] = []
    plain = _plain(first)
    same = _runs(first, model, plain)
    first.fit_loop.epoch_loop.max_steps = 4  # two more steps on the same Trainer
    first.fit(model, train_dataloaders=_loader(0))
    _check_next_fit(model, plain)
    assert first.global_step == 4
    plain = _plain(first)
    second = _trainer()
    new = _runs(second, model, plain)
    second.fit(model, train_dataloaders=_loader(0))
    _check_next_fit(model, plain)
    assert second.global_step == 2
    return {"same_trainer": same, "new_trainer": new}


def test_fit_then_validate_test_predict_and_fit_again():
    for rank, result in enumerate(run_distributed(_worker, WORLD, timeout_s=240)):
        for runs in result.values():
            assert runs["val"] == 2 and runs["test"] == 2 and runs["predict"] >= 1, (rank, result)
