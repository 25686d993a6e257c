"""``Trainer(accumulate_grad_batches=2)`` under ``MoEOverlapStrategy`` (2 gloo ranks, ``MoEGPT``, SGD).

Oracles the strategy does not share:

- plain Lightning's accumulation in one process (``Trainer(devices=1)``, no strategy) on the global batch: each
  batch's loss Lightning returns and every parameter after the steps within 1e-5 (the routers' balancing loss off:
  it is not linear in the batch, so a dp split changes it);
- with the balancing loss on, the same tokens as one batch of twice the micro-batches without accumulation: the
  micro-batches meet the same weights in the same order and their gradients add up in the same order, so the
  parameters are bitwise equal;
- gradient collectives (``all_reduce`` / ``reduce_scatter_tensor`` calls of torch.distributed, counted) per optimizer
  step: as many with accumulation as without.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler

from lightning_moe_overlap import MoEOverlapStrategy
from tests.helpers.data import RandomTokens
from tests.helpers.distributed import run_distributed
from tests.helpers.sgd import SGDGPT
from tests.helpers.tolerance import assert_within, decoder_chain, trained_param_tol

STEPS, SAMPLES, SEQ, VOCAB = 2, 32, 6, 32
MODEL = dict(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2, num_experts=4, top_k=2, ffn_hidden_size=8)
TOKENS = 8 * (SEQ - 1)  # a step's targets on a rank: 2 batches of 4 sequences
CHAIN = decoder_chain(layers=2, hidden=16, heads=2, head_dim=8, ffn=8, experts=4, top_k=2, vocab=VOCAB, seq=SEQ - 1,
                      tokens=TOKENS)  # fmt: skip


class Record(Callback):
    """The loss Lightning got for each batch, and the gradient collectives called per optimizer step."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.logged: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))
        self.logged.append(float(trainer.callback_metrics["train_loss"]))


class CountCollectives:
    """Counts calls of torch.distributed's gradient reductions (of floating-point tensors) while entered (module
    attributes patched)."""

    NAMES = ("all_reduce", "reduce_scatter_tensor")

    def __enter__(self) -> CountCollectives:
        self.calls = 0
        self.saved = {name: getattr(dist, name) for name in self.NAMES}
        for name, fn in self.saved.items():
            setattr(dist, name, self._counted(fn))
        return self

    def _counted(self, fn):
        def call(*args, **kwargs):
            tensor = args[0] if args else next(iter(kwargs.values()))
            self.calls += tensor.is_floating_point()  # gradients; not the batch boundary's flag (processes/signals.py)
            return fn(*args, **kwargs)

        return call

    def __exit__(self, *exc: object) -> None:
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def fit(strategy: MoEOverlapStrategy | None, *, batch_size: int, accumulate: int, aux: float, devices: int = 2) -> dict:
    seed_everything(0)
    model = SGDGPT(**MODEL, aux_loss_coeff=aux)
    record = Record()
    trainer = Trainer(
        accelerator="cpu", devices=1 if strategy is None else devices, strategy=strategy or "auto",
        max_steps=STEPS, accumulate_grad_batches=accumulate, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[record],
    )  # fmt: skip
    init = {n: p.detach().clone() for n, p in model.named_parameters()}  # built in __init__: whole
    data = RandomTokens(SAMPLES, SEQ, VOCAB, seed=1)
    # dp rank r reads samples r, r + dp, ... in order (Lightning would shuffle its own DistributedSampler)
    sampler = None
    if strategy is not None:
        sampler = DistributedSampler(data, **strategy.distributed_sampler_kwargs, shuffle=False)
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler)
    with CountCollectives() as counted:
        trainer.fit(model, train_dataloaders=loader)
    # whole tensors (a collective over each parameter's mesh, in the same order on every rank): shards of any shape
    params = {n: _whole(p) for n, p in model.named_parameters() if not p.is_meta}
    return {
        "losses": record.losses, "logged": record.logged, "params": params, "collectives": counted.calls,
        "steps": trainer.global_step, "init": init,
    }


def _whole(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()


LAYOUTS = {  # name: (processes, dp, strategy arguments)
    "ep2": (2, 2, dict(ep=2, overlap=True)),
    "ep2-full": (2, 2, dict(ep=2, shard="full", overlap=True)),
    "pp2": (2, 1, dict(pp=2, pipeline_schedule="1f1b")),
    "ep2-full-dp4": (4, 4, dict(ep=2, shard="full", overlap=True)),
}


def worker(rank: int, world_size: int, layout: str) -> dict:
    def strategy(num_microbatches: int) -> MoEOverlapStrategy:
        return MoEOverlapStrategy(num_microbatches=num_microbatches, timeout=120, **LAYOUTS[layout][2])

    def run(microbatches: int, batch_size: int, accumulate: int, aux: float) -> dict:
        return fit(strategy(microbatches), batch_size=batch_size, accumulate=accumulate, aux=aux, devices=world_size)

    return {
        "accumulated": run(2, 4, 2, 0.0),
        "accumulated_aux": run(2, 4, 2, 0.1),
        "one_batch_aux": run(4, 8, 1, 0.1),
    }


@pytest.mark.parametrize(
    "layout", ["ep2", "ep2-full", "pp2", pytest.param("ep2-full-dp4", marks=pytest.mark.long)]
)
def test_accumulate_grad_batches_equals_plain_lightning_and_one_larger_batch(layout: str) -> None:
    processes, dp, args = LAYOUTS[layout]
    ranks = run_distributed(worker, processes, layout, timeout_s=300)
    # one process, the global batch (the dp ranks' 4 samples each: DistributedSampler deals them out in turn)
    oracle = fit(None, batch_size=4 * dp, accumulate=2, aux=0.0)
    assert oracle["steps"] == STEPS and len(oracle["losses"]) == STEPS * 2
    for rank, runs in enumerate(ranks):
        acc = runs["accumulated"]
        assert acc["steps"] == STEPS and len(acc["losses"]) == STEPS * 2, rank
        # each dp rank's batch loss is its share's mean; the shares are of equal size: their mean is the global one
        for key in ("losses", "logged"):  # what Lightning got (divided by 2, as it divides), what the module logged
            mean = torch.stack([torch.tensor(r["accumulated"][key]) for r in ranks[:dp]]).mean(0)
            got = mean if dp == processes else torch.tensor(acc[key])  # pp: every rank has the last stage's
            torch.testing.assert_close(got, torch.tensor(oracle[key]), rtol=1e-5, atol=0, msg=lambda m: f"{key} {m}")
        for name, got in acc["params"].items():
            want = oracle["params"][name]
            scale = want.abs().max().item()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"{rank} {name} {m}")
        one = runs["one_batch_aux"]
        for name, got in runs["accumulated_aux"]["params"].items():
            if "pp" in layout:  # torch's schedule divides by M after the step without accumulation: reordered
                want = one["params"][name]
                bound = trained_param_tol(CHAIN, TOKENS, init=one["init"][name], want=want)
                assert_within(got, want, bound, f"{rank} {name}")
            else:
                assert torch.equal(got, one["params"][name]), (rank, name)
        # the gradient reductions run once per optimizer step, as without accumulation
        assert runs["accumulated_aux"]["collectives"] == one["collectives"], (rank, runs["accumulated_aux"], one)
