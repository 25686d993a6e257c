"""``MoEOverlapStrategy(pp=2, vpp=2, cp=2, ep=2)`` on 4 gloo ranks (dp=1): the splitter gives each cp rank its
shard of every sequence (targets shifted on the whole sequence first), the chunks' attention runs in the ring on
whichever thread runs them, the routers' statistics and the gradients are reduced over cp as at pp = 1; and Hugging
Face DeepSeek-V3 (latent attention: values narrower than the queries) at ``cp=2`` without a pipeline.

Oracles, from one spawn:
- one process training the unsplit model on the same global batches (plain SGD, the gradients clipped by their
  global norm; no strategy code): the mean over the cp ranks of each step's loss within 1e-5 and every parameter of
  the consolidated state within 1e-5 after the steps, for ``MoEGPT``, HF Qwen3-MoE and HF DeepSeek-V3 (its
  correction bias) at pp=2 x cp=2, DeepSeek-V3 at pp=1 x cp=2 (dp=2) and at cp=2 x tp=2; and a validation batch after
  training, its loss (averaged over the ranks) within 1e-5 of the unsplit model's on the same batch;
- the overlapped schedule against the sequential one at each: the consolidated states equal bitwise; and bitwise the
  same training with ``shard="full"`` (with ``overlap_grad_reduce``) as with ``shard="none"``;
- per rank, what the first chunk it holds receives: ``T / cp`` tokens of each sequence.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback
from torch.utils.data import DataLoader

from lightning_moe_overlap import MoEOverlapStrategy
from tests.distributed.test_pipeline_sharded import CLIP, Losses, _trainer, build
from tests.distributed.test_pipeline_tensor_parallel import EP, SEQ, STEPS, G, M, loader, reference, tokens
from tests.helpers.distributed import run_distributed
from tests.helpers.runs import assert_same_training

WORLD, CP = 4, 2
RUNS = (  # (name, model, pp, shard, overlap, other settings)
    ("gpt", "gpt", 2, "none", True, {}),
    ("gpt-off", "gpt", 2, "none", False, {}),
    ("qwen3", "qwen3", 2, "none", True, {}),
    ("qwen3-off", "qwen3", 2, "none", False, {}),
    ("deepseek", "deepseek", 2, "none", True, {}),
    ("deepseek-off", "deepseek", 2, "none", False, {}),
    ("gpt-full-early", "gpt", 2, "full", True, {"overlap_grad_reduce": True}),
    ("deepseek-pp1", "deepseek", 1, "none", True, {}),
    ("deepseek-pp1-off", "deepseek", 1, "none", False, {}),
    ("deepseek-tp2", "deepseek", 1, "none", True, {"tp": 2}),  # latent attention: heads over tp inside the ring
)
BITWISE = (
    ("gpt", "gpt-off"), ("qwen3", "qwen3-off"), ("deepseek", "deepseek-off"), ("deepseek-pp1", "deepseek-pp1-off"),
    ("gpt-full-early", "gpt"),
)  # fmt: skip
VALIDATED = "gpt"  # the run that also validates a held-out batch after training


def held_out() -> torch.Tensor:
    """``[G, S]``: one validation batch (every rank reads all of it)."""
    return torch.randint(0, 32, (G, SEQ[VALIDATED]), generator=torch.Generator().manual_seed(11))


class Received(Callback):
    """What the first held chunk receives at its first forwards: the shape of its first input."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    def on_train_start(self, trainer, pl_module) -> None:
        trainer.strategy.prepared.pipeline.held_chunks[0].register_forward_pre_hook(self._record)

    def _record(self, module, args) -> None:
        if len(self.shapes) < 4:
            self.shapes.append(tuple(args[0].shape))


def fit(
    kind: str, pp: int, shard: str, overlap: bool, settings: dict, validate: bool = False, world: int = WORLD
) -> dict:
    """Train ``kind`` at this layout on ``world`` ranks, ``M / dp`` micro-batches per dp rank (the same global
    micro-batches whatever dp is); with ``validate``, then validate :func:`held_out`."""
    model = build(kind)
    layout = {"pp": pp, "vpp": 2} if pp > 1 else {}
    dp = world // (pp * CP * settings.get("tp", 1))
    strategy = MoEOverlapStrategy(ep=EP, cp=CP, shard=shard, overlap=overlap, num_microbatches=M // dp, timeout=120,
                                  **layout, **settings)  # fmt: skip
    losses, received = Losses(), Received()
    trainer = _trainer(strategy, [losses, *([received] if pp > 1 else [])], world, max_steps=STEPS,
                       gradient_clip_val=CLIP, enable_checkpointing=False)  # fmt: skip
    coords = strategy.dims.coords(trainer.global_rank)
    trainer.fit(model, train_dataloaders=loader(kind, coords.dp, strategy.dims.dp))
    val_loss = None
    if validate:
        trainer.limit_val_batches = 1
        validation = DataLoader(held_out()[None], batch_size=None)  # one batch of G samples
        val_loss = float(trainer.validate(model, validation, verbose=False)[0]["val_loss"])
    return {
        "dp": coords.dp,
        "cp": coords.cp,
        "losses": losses.losses,
        "full": strategy.full_state_dict(),  # collective: the consolidated state on rank 0
        "received": received.shapes,
        "val_loss": val_loss,
    }


def worker(rank: int, world: int, root: Path) -> dict:
    torch.use_deterministic_algorithms(True)
    return {
        name: fit(kind, pp, shard, overlap, settings, validate=name == VALIDATED)
        for name, kind, pp, shard, overlap, settings in RUNS
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_distributed(worker, WORLD, tmp_path_factory.mktemp("pipeline_cp"), timeout_s=400)


@pytest.mark.parametrize("name", ["gpt", "qwen3", "deepseek", "deepseek-pp1", "deepseek-tp2"])
def test_context_parallel_pipeline_matches_one_process(results: list[dict], name: str) -> None:
    kind, pp, settings = next((k, p, rest[-1]) for n, k, p, *rest in RUNS if n == name)
    dp = WORLD // (pp * CP * settings.get("tp", 1))
    ref_losses, ref_state = reference(kind, dp, M // dp)
    for d in range(dp):  # each rank's loss is its share: the mean over the cp ranks is the whole sequences' loss
        shares = [runs[name]["losses"] for runs in results if runs[name]["dp"] == d]
        assert len(shares) == WORLD // dp and all(len(s) == STEPS for s in shares), (name, d)
        for step, want in enumerate(ref_losses[d]):
            got = sum(s[step] for s in shares) / len(shares)
            assert abs(got - want) < 1e-5, (name, d, step, got, want)
        assert len({s[0] for s in shares}) > 1, (name, shares)  # the cp ranks saw different tokens
    full = results[0][name]["full"]
    assert set(full) == set(ref_state), (name, set(full) ^ set(ref_state))
    for key, want in ref_state.items():
        torch.testing.assert_close(full[key], want, rtol=1e-5, atol=1e-5, msg=f"{name} {key}")
    assert any(not torch.equal(full[k], v) for k, v in build(kind).state_dict().items())  # the steps moved it


def test_validation_after_training_matches_the_unsplit_model(results: list[dict]) -> None:
    model = build(VALIDATED)
    model.load_state_dict(results[0][VALIDATED]["full"])
    with torch.no_grad():
        want = sum(float(model._loss(part)) for part in held_out().chunk(M)) / M
    for rank, runs in enumerate(results):
        assert abs(runs[VALIDATED]["val_loss"] - want) < 1e-5, (rank, runs[VALIDATED]["val_loss"], want)


def test_overlap_equals_sequential_and_sharding_changes_nothing_bitwise(results: list[dict]) -> None:
    assert_same_training(results, BITWISE)


@pytest.mark.parametrize("name", ["gpt", "qwen3", "deepseek"])
def test_each_rank_receives_its_share_of_every_sequence(results: list[dict], name: str) -> None:
    kind = next(k for n, k, *_ in RUNS if n == name)
    whole = SEQ[kind] - (1 if kind == "gpt" else 0)  # the model's input tokens per sequence
    for rank, runs in enumerate(results):
        shapes = runs[name]["received"]
        assert shapes, rank
        for shape in shapes:  # token ids on the first stage, hidden states on the second
            assert shape[0] == G // M and shape[1] == whole // CP, (rank, shapes)
    assert tokens(kind).shape == (STEPS * G, SEQ[kind])
