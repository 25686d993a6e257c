"""Context parallelism with tensor parallelism: ``MoEOverlapStrategy(cp=2, tp=2, ep=2)`` on 4 gloo ranks (dp=1),
``MoEGPT`` with its balancing loss and a shared expert, SGD.

Each cp rank holds half of every sequence and, under sequence parallelism, each tp rank half of that: the attention's
heads are split over tp inside the ring, and every router counts its balancing loss over the ``cp x tp`` group (the
ranks holding the parts of the same sequences).

Oracles: one process training the unsplit model on the same batches, whole sequences (its own loss, balancing loss
and shared expert; no strategy code): the mean of the cp ranks' losses per step and every parameter within 1e-5; the
overlapped schedule bitwise equal to the sequential one; each router's sequence group is exactly the ``cp x tp``
ranks of its dp index.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.moe.router import TopKRouter
from tests.helpers.distributed import run_distributed
from tests.helpers.sgd import SGDGPT

WORLD, CP, TP, EP, STEPS, BATCH, MICRO, SEQ = 4, 2, 2, 2, 2, 4, 2, 17  # 16 inputs: 2 x cp chunks, then / tp
GPT = {"vocab_size": 64, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_experts": 4, "top_k": 2,
       "ffn_hidden_size": 16, "shared_expert_ffn_hidden_size": 16, "aux_loss_coeff": 0.1}  # fmt: skip


def tokens() -> torch.Tensor:
    return torch.randint(0, 64, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(7))


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.groups: list[list[int]] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.groups = [dist.get_process_group_ranks(m.sequence_group) for m in pl_module.modules()
                       if isinstance(m, TopKRouter)]  # fmt: skip

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def fit(overlap: bool) -> dict:
    torch.manual_seed(0)
    model = SGDGPT(**GPT)
    record = Losses()
    strategy = MoEOverlapStrategy(ep=EP, cp=CP, tp=TP, num_microbatches=MICRO, overlap=overlap, timeout=120)
    trainer = Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=STEPS, logger=False, limit_val_batches=0,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, callbacks=[record],
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=DataLoader(tokens(), batch_size=BATCH))  # dp=1: every rank reads all
    return {
        "losses": record.losses, "groups": record.groups, "cp": strategy.dims.coords(trainer.global_rank).cp,
        "cp_tp": strategy.dims.group_of("cp_tp", trainer.global_rank), "full": strategy.full_state_dict(),
    }  # fmt: skip


def worker(rank: int, world: int) -> dict:
    torch.use_deterministic_algorithms(True)
    return {"on": fit(True), "off": fit(False)}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(worker, WORLD, timeout_s=300)


def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """The unsplit model: each micro-batch backpropagates ``loss / MICRO``; the routers' balancing loss enters the
    gradient with the same weight (``aux_loss_scale``: the router adds its gradient itself, not through the loss)."""
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    model = SGDGPT(**GPT)
    for router in (m for m in model.modules() if isinstance(m, TopKRouter)):
        router.aux_loss_scale = 1.0 / MICRO
    opt = model.configure_optimizers()
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for part in tokens()[step * BATCH : (step + 1) * BATCH].chunk(MICRO):
            loss = model._loss(part)
            (loss / MICRO).backward()
            total += float(loss.detach()) / MICRO
        opt.step()
        losses.append(total)
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def test_cp2_tp2_follows_one_process_and_overlap_is_bitwise(results: list[dict]) -> None:
    ref_losses, ref_state = reference()
    for step in range(STEPS):  # each cp rank's loss is the mean over its half: the cp mean is the step's
        by_cp = {r["on"]["cp"]: r["on"]["losses"][step] for r in results}
        assert abs(sum(by_cp.values()) / CP - ref_losses[step]) < 1e-5, (step, by_cp, ref_losses)
    full, off = results[0]["on"]["full"], results[0]["off"]["full"]
    assert set(full) == set(ref_state)
    for key, want in ref_state.items():
        assert torch.equal(full[key], off[key]), key
        torch.testing.assert_close(full[key], want, rtol=1e-5, atol=1e-5, msg=key)
    for r in results:
        assert r["on"]["losses"] == r["off"]["losses"]
        assert len(r["on"]["cp_tp"]) == CP * TP
        assert r["on"]["groups"] and all(g == r["on"]["cp_tp"] for g in r["on"]["groups"]), r["on"]["groups"]
