"""An epoch whose last batch is short (``drop_last=False``), on 2 gloo ranks.

- pp=1, ep=2, ``num_microbatches=2``: 18 samples, batch 4, so each rank's epoch is 4, 4 and 1 rows. The epoch runs to
  its end, and every step's loss and the parameters after it equal a plain one-process SGD run of the unsplit model
  on the same batches (the mean over the ranks of each rank's mean loss).
- pp=2: 17 samples, a last batch of 1 row (torch's schedules fix the micro-batches' shapes at the first step):
  refused before the first step, naming the rows and the fix.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader, DistributedSampler

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.parallel.dtensors import local
from tests.helpers.distributed import run_distributed

WORLD, BATCH, MICRO, LR, V, S = 2, 4, 2, 0.5, 32, 6
MODEL = dict(vocab_size=V, hidden_size=16, num_layers=2, num_heads=2, num_experts=4, top_k=2, ffn_hidden_size=8,
             aux_loss_coeff=0.0)  # fmt: skip


def tokens(samples: int) -> torch.Tensor:
    return torch.randint(0, V, (samples, S + 1), generator=torch.Generator().manual_seed(3))


class SGDGPT(MoEGPT):
    def __init__(self, samples: int) -> None:
        torch.manual_seed(0)
        super().__init__(**MODEL)
        self.samples = samples

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self) -> DataLoader:  # in order: rank r takes samples r, r + 2, ...
        data = tokens(self.samples)
        sampler = DistributedSampler(data, shuffle=False, **self.trainer.strategy.distributed_sampler_kwargs)
        return DataLoader(data, batch_size=BATCH, sampler=sampler, drop_last=False)


class Record(Callback):
    def __init__(self) -> None:
        self.rows: list[int] = []
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.rows.append(batch.shape[0])
        self.losses.append(float(outputs["loss"]))


def _fit(samples: int, pp: int) -> dict:
    model, record = SGDGPT(samples), Record()
    strategy = MoEOverlapStrategy(ep=2 if pp == 1 else 1, pp=pp, num_microbatches=MICRO, timeout=120)
    trainer = Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        use_distributed_sampler=False, callbacks=[record],
    )  # fmt: skip
    try:
        trainer.fit(model)
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        return {"error": f"{type(err).__name__}: {err}", "steps": trainer.global_step}
    params = {n: local(p).detach().clone() for n, p in model.named_parameters()}
    return {"rows": record.rows, "losses": record.losses, "steps": trainer.global_step, "params": params,
            "rank": trainer.global_rank}  # fmt: skip


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    return {"pp1": _fit(18, pp=1), "pp2": _fit(17, pp=2)}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_worker, WORLD, timeout_s=180)


def _reference(samples: int, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the unsplit model, plain autograd: each step's loss is the mean over the ranks of each rank's
    mean next-token loss on its batch (rank r's batches: samples r, r + 2, ... in runs of BATCH)."""
    model = SGDGPT(samples)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = tokens(samples)
    per_rank = [data[r::WORLD] for r in range(WORLD)]
    losses = []
    for step in range(steps):
        opt.zero_grad()
        rank_losses = []
        for rows in per_rank:
            batch = rows[step * BATCH : (step + 1) * BATCH]
            logits = model(batch[:, :-1])
            rank_losses.append(F.cross_entropy(logits.reshape(-1, V), batch[:, 1:].reshape(-1)))
        loss = torch.stack(rank_losses).mean()
        loss.backward()
        opt.step()
        losses.append([float(x.detach()) for x in rank_losses])
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def test_a_short_last_batch_trains_like_one_plain_process(results: list[dict]) -> None:
    ref_losses, ref_params = _reference(18, steps=3)
    for rank, r in enumerate(results):
        run = r["pp1"]
        assert "error" not in run, run.get("error")
        assert run["rows"] == [4, 4, 1] and run["steps"] == 3, (rank, run["rows"])
        for got, want in zip(run["losses"], ref_losses):
            assert abs(got - want[rank]) < 1e-5, (rank, run["losses"], ref_losses)
        for name, got in run["params"].items():
            want = ref_params[name]
            if got.shape != want.shape:  # this rank's experts: rows [rank * E/2, (rank + 1) * E/2) of dim 0
                want = want.chunk(WORLD)[rank]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{rank} {name}: {m}")


def test_a_last_batch_the_pipeline_cannot_split_is_refused_before_the_first_step(results: list[dict]) -> None:
    for r in results:
        run = r["pp2"]
        assert run["steps"] == 0
        assert run["error"].startswith("ValueError"), run["error"]
        assert "the epoch's last batch would hold 1 of batch_size=4 rows" in run["error"] and "drop_last=True" in run["error"]
