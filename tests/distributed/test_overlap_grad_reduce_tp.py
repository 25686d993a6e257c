"""``overlap_grad_reduce=True`` with tensor parallelism on 4 gloo ranks (``tp=2 x dp=2``, ep=2, ``MoEGPT`` with its
plan, ``shard="full"`` and ``"optimizer"``, 3 micro-batches, AdamW, clipping by the global norm): each FSDP unit's
tensor-parallel replicas (norms, routers) are summed over tp just before the unit's early reduction over dp
(``TensorParallelGrads.unit_reducer``), the rest at the end of the step.

Oracles: the optimizer's parameter shards after 3 steps are bitwise those of the end-of-step reduction (the flag
off: every replica summed over tp, then every unit reduced). A sum over 2 tp ranks is one addition, the same
whichever step issues it, so any other result means a unit was reduced before its replicas were summed (its
reduce-scatter would then have taken one tp rank's share only). The early reduction's own record shows each unit
issued once per step, during the last backward, with the flag on.
"""

from __future__ import annotations

import torch
from lightning.pytorch import Callback, Trainer
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo import MoEGPT
from tests.helpers.distributed import run_distributed

WORLD, TP, EP, STEPS, BATCH, MICRO, VOCAB, SEQ = 4, 2, 2, 3, 6, 3, 64, 8


def _model() -> MoEGPT:
    torch.manual_seed(0)
    model = MoEGPT(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_experts=4, top_k=2,
                   ffn_hidden_size=16, lr=1e-2)  # fmt: skip
    data = torch.randint(0, VOCAB, (2 * BATCH * STEPS, SEQ + 1), generator=torch.Generator().manual_seed(5))
    model.train_dataloader = lambda: DataLoader(data, batch_size=BATCH)
    return model


class _Issued(Callback):
    def __init__(self) -> None:
        self.issued: list[str] = []

    def on_train_start(self, trainer, pl_module) -> None:
        trainer.strategy.prepared.sharded.observe_reduction(
            lambda event, unit: self.issued.append(unit) if event == "issue" else None
        )


def _fit(shard: str, early: bool) -> dict:
    model, issued = _model(), _Issued()
    trainer = Trainer(
        accelerator="cpu", devices=WORLD, max_steps=STEPS, gradient_clip_val=0.5, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[issued],
        strategy=MoEOverlapStrategy(ep=EP, tp=TP, num_microbatches=MICRO, shard=shard, overlap_grad_reduce=early),
    )  # fmt: skip
    trainer.fit(model)
    params = [p for g in trainer.optimizers[0].param_groups for p in g["params"]]
    return {
        "shards": [(p.to_local() if isinstance(p, DTensor) else p).detach().clone() for p in params],
        "issued": issued.issued,
        "units": [name for name, _ in trainer.strategy.prepared.sharded.named_units()],
    }


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    return {(shard, early): _fit(shard, early) for shard in ("full", "optimizer") for early in (False, True)}


def test_early_reduction_at_tp2_is_bitwise_the_end_of_step_one():
    results = run_distributed(_worker, WORLD, timeout_s=600)
    for rank, per_rank in enumerate(results):
        for shard in ("full", "optimizer"):
            late, early = per_rank[(shard, False)], per_rank[(shard, True)]
            assert len(late["shards"]) == len(early["shards"])
            for i, (a, b) in enumerate(zip(late["shards"], early["shards"])):
                assert torch.equal(a, b), f"rank {rank}, shard={shard}, parameter {i}: differs with the flag"
            units = early["units"]
            assert "layers.0" in units and "layers.1" in units, units
            assert sorted(early["issued"]) == sorted(units * STEPS), "each unit issued early once per step"
            assert late["issued"] == []
