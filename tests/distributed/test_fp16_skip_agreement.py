"""``16-mixed`` (a ``GradScaler``) under ``MoEOverlapStrategy(ep=2)`` on 2 gloo ranks: an overflow in ONE rank's expert
gradient makes EVERY rank skip the step.

An ``inf`` is planted in rank 1's local expert gradient after the last backward of step 0. Oracles, per rank: the
parameters after step 0 are the initial ones (a skipped step changes nothing), the loss scale is
``init_scale * backoff_factor`` on both ranks (each recorded one overflow), and at the end the dense parameters
are equal across the ranks (replicas), as are the scales.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo import MoEGPT, _PatternTokens
from lightning_moe_overlap.parallel.dtensors import local
from tests.helpers.distributed import run_distributed

WORLD, MICRO, BATCH, INIT_SCALE = 2, 2, 4, 256.0


class Planted(MoEGPT):
    """The demo model; rank 1 plants an ``inf`` in one expert gradient after the last backward of step 0."""

    def __init__(self) -> None:
        super().__init__(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_experts=4, top_k=2,
                         ffn_hidden_size=16, lr=1e-2)
        self.backwards = 0
        self.after_step: list[list[torch.Tensor]] = []
        self.scales: list[float] = []

    def on_after_backward(self) -> None:
        self.backwards += 1
        if self.backwards == MICRO and dist.get_rank() == 1:
            expert = next(p for n, p in self.named_parameters() if ".experts." in n and p.grad is not None)
            with torch.no_grad():
                local(expert.grad).view(-1)[0] = float("inf")

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.after_step.append([local(p.detach()).clone() for p in self.parameters()])
        self.scales.append(float(self.trainer.precision_plugin.wrapped.scaler.get_scale()))

    def train_dataloader(self):
        return DataLoader(_PatternTokens(16, 8, 64, seed=0), batch_size=BATCH, drop_last=True)


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    model = Planted()
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=1000)
    trainer = Trainer(
        accelerator="cpu", devices=WORLD, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        strategy=MoEOverlapStrategy(ep=2, num_microbatches=MICRO),
    )
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.fit(model)
    fused = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    fused._step_supports_amp_scaling = True  # what torch's fused optimizers set: they unscale inside `step`
    try:
        trainer.precision_plugin.optimizer_step(fused, model, closure=lambda: None)
        refusal = ""
    except NotImplementedError as err:
        refusal = str(err)
    names = [n for n, _ in model.named_parameters()]
    # on_train_batch_end's list follows model.parameters(): the experts hold this rank's half of the initial ones
    first = dict(zip(names, model.after_step[0]))
    unchanged = [n for n in names if ".experts." not in n and torch.equal(first[n], initial[n])]
    return {
        "refusal": refusal,
        "scales": model.scales,
        "dense_unchanged": len(unchanged),
        "dense": len([n for n in names if ".experts." not in n]),
        "dense_end": {n: t for n, t in zip(names, model.after_step[-1]) if ".experts." not in n},
        "experts_moved_at_end": any(
            not torch.equal(a, b) for n, a, b in zip(names, model.after_step[0], model.after_step[-1])
            if ".experts." in n
        ),
    }


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    results = run_distributed(_worker, WORLD, timeout_s=180)
    for rank, r in enumerate(results):
        assert r["scales"][0] == INIT_SCALE * 0.5, (rank, r["scales"])  # one overflow recorded, on every rank
        assert r["dense_unchanged"] == r["dense"], (rank, r["dense_unchanged"], r["dense"])  # step 0 skipped
        assert r["experts_moved_at_end"], rank  # step 1 trained
    assert results[0]["scales"] == results[1]["scales"]
    with pytest.raises(NotImplementedError, match=r"`SGD` unscales gradients inside its own `step` .*on 2 ranks.*"
                       r"Use a non-fused optimizer"):
        raise NotImplementedError(results[0]["refusal"])
    for name, value in results[0]["dense_end"].items():
        assert torch.equal(value, results[1]["dense_end"][name]), name
