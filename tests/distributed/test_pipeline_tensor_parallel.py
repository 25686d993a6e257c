"""``MoEOverlapStrategy(pp=2, vpp=2, tp=2, ep=2)`` on 4 gloo ranks (dp=1; ep folds over tp): each chunk
tensor-parallel by the model's plan with sequence parallelism, the stage boundaries carrying each tp rank's
``S / tp`` positions, the loss-parallel head on the last stage; and Hugging Face DeepSeek-V3 (multi-head latent
attention) at ``tp=2`` without a pipeline.

Oracles, from one spawn:
- one process training the unsplit model on the same global batches (plain SGD, the gradients clipped by their
  global norm; no strategy code): the per-step losses within 1e-5 and every parameter of the consolidated state
  within 1e-5 after the steps, for ``MoEGPT``, HF Qwen3-MoE and HF DeepSeek-V3 (its correction bias, its latent
  attention's down-projections) at pp=2 x tp=2, ``MoEGPT`` also under DualPipeV (overlapped) and zero-bubble (whose
  split backwards detach the loss in place), and DeepSeek-V3 at pp=1 x tp=2 (dp=2);
- the overlapped schedule against the sequential one at each: the consolidated states equal bitwise; and bitwise the
  same training with ``shard="full"`` (with and without ``overlap_grad_reduce``) as with ``shard="none"``;
- per rank, what it holds and sends: the attention's output projection a ``DTensor`` ``Shard(1)`` over the 2 tp
  ranks, the other stage's chunks on meta, and every chunk that ends before the head returning a plain tensor of
  ``S / tp`` positions.

Shapes: G samples per step, S tokens per sample (the HF models see all S, ``MoEGPT`` S - 1 inputs), M micro-batches.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Subset

from lightning_moe_overlap import MoEOverlapStrategy
from tests.distributed.test_pipeline_sharded import BIAS_RATE, CLIP, Losses, _trainer, build
from tests.helpers.distributed import run_distributed
from tests.helpers.runs import assert_same_training
from tests.helpers.unsplit import correction_bias_steps, train_unsplit

WORLD, TP, EP, M, G, STEPS, VOCAB = 4, 2, 2, 4, 8, 2, 32
SEQ = {"gpt": 9, "qwen3": 8, "deepseek": 8}  # every tp rank holds S / tp positions of each sample's inputs
RUNS = (  # (name, model, pp, shard, overlap, other settings)
    ("gpt", "gpt", 2, "none", True, {}),
    ("gpt-off", "gpt", 2, "none", False, {}),
    ("qwen3", "qwen3", 2, "none", True, {}),
    ("qwen3-off", "qwen3", 2, "none", False, {}),
    ("deepseek", "deepseek", 2, "none", True, {}),
    ("deepseek-off", "deepseek", 2, "none", False, {}),
    ("gpt-full", "gpt", 2, "full", True, {}),
    ("gpt-full-early", "gpt", 2, "full", True, {"overlap_grad_reduce": True}),
    ("gpt-dualpipev", "gpt", 2, "none", True, {"pipeline_schedule": "dualpipev"}),
    ("gpt-zero-bubble", "gpt", 2, "none", False, {"pipeline_schedule": "zero_bubble"}),  # split backwards
    ("deepseek-pp1", "deepseek", 1, "none", True, {}),
    ("deepseek-pp1-off", "deepseek", 1, "none", False, {}),
)
BITWISE = (
    ("gpt", "gpt-off"), ("qwen3", "qwen3-off"), ("deepseek", "deepseek-off"), ("deepseek-pp1", "deepseek-pp1-off"),
    ("gpt-full", "gpt"), ("gpt-full-early", "gpt"),
)  # fmt: skip


def tokens(kind: str) -> torch.Tensor:
    """``[STEPS * G, S]``: the samples of every step, in order."""
    return torch.randint(0, VOCAB, (STEPS * G, SEQ[kind]), generator=torch.Generator().manual_seed(7))


def loader(kind: str, dp_rank: int, dp: int) -> DataLoader:
    """This dp rank's share of each step's G samples, in order (every pp and tp rank of it reads the same)."""
    per = G // dp
    index = [s * G + dp_rank * per + i for s in range(STEPS) for i in range(per)]
    return DataLoader(Subset(tokens(kind), index), batch_size=per)


class Boundaries(Callback):
    """What each held chunk returns at its first forward: (type, shape), the head's chunk excepted."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, tuple[int, ...]]] = []

    def on_train_start(self, trainer, pl_module) -> None:
        pipeline = trainer.strategy.prepared.pipeline
        last = pipeline.layout.num_chunks - 1
        for index, chunk in zip(pipeline.held, pipeline.held_chunks):
            if index != last:
                chunk.register_forward_hook(self._record)

    def _record(self, module, args, output) -> None:
        if len(self.sent) < 8:
            self.sent.append((type(output).__name__, tuple(output.shape)))


def fit(kind: str, pp: int, shard: str, overlap: bool, settings: dict, world: int = WORLD) -> dict:
    """Train ``kind`` at this layout on ``world`` ranks: ``M / dp`` micro-batches per dp rank (of G / M samples each,
    whatever dp is: the same global micro-batches)."""
    model = build(kind)
    layout = {"pp": pp, "vpp": 2} if pp > 1 else {}
    micro = M // (world // (pp * TP))
    strategy = MoEOverlapStrategy(ep=EP, tp=TP, shard=shard, overlap=overlap, num_microbatches=micro, timeout=120,
                                  **layout, **settings)  # fmt: skip
    losses, boundaries = Losses(), Boundaries()
    trainer = _trainer(strategy, [losses, *([boundaries] if pp > 1 else [])], world, max_steps=STEPS,
                       gradient_clip_val=CLIP, enable_checkpointing=False)  # fmt: skip
    coords = strategy.dims.coords(trainer.global_rank)
    trainer.fit(model, train_dataloaders=loader(kind, coords.dp, strategy.dims.dp))
    projections = [
        p for n, p in model.named_parameters() if n.endswith(("attn.proj.weight", "o_proj.weight")) and not p.is_meta
    ]  # fmt: skip
    return {
        "dp": coords.dp,
        "losses": losses.losses,
        "full": strategy.full_state_dict(),  # collective: the consolidated state on rank 0
        "meta": sorted(n for n, p in model.named_parameters() if p.is_meta),
        "projections": [_layout(p) for p in projections],
        "sent": boundaries.sent,
    }


def _layout(p: torch.Tensor) -> tuple:
    """(class, placements, local shape, global shape) of a parameter."""
    if isinstance(p, DTensor):
        return type(p).__name__, tuple(map(str, p.placements)), tuple(p.to_local().shape), tuple(p.shape)
    return type(p).__name__, (), tuple(p.shape), tuple(p.shape)


def worker(rank: int, world: int, root: Path) -> dict:
    torch.use_deterministic_algorithms(True)
    return {name: fit(kind, pp, shard, overlap, settings) for name, kind, pp, shard, overlap, settings in RUNS}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_distributed(worker, WORLD, tmp_path_factory.mktemp("pipeline_tp"), timeout_s=400)


def reference(kind: str, dp: int, micro: int) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """The unsplit model in one process: per step, each of ``dp`` ranks' ``micro`` micro-batches backpropagates
    ``loss / (dp * micro)``, clip, SGD, DeepSeek-V3's bias step (``tests/helpers/unsplit.py``)."""
    torch.use_deterministic_algorithms(True)
    model = build(kind)
    data, per = tokens(kind), G // dp
    batches = [[data[s * G + d * per : s * G + (d + 1) * per] for d in range(dp)] for s in range(STEPS)]
    losses = train_unsplit(model, model.configure_optimizers(), batches, micro, CLIP,
                           after_step=correction_bias_steps(model, BIAS_RATE))  # fmt: skip
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", ["gpt", "qwen3", "deepseek", "gpt-dualpipev", "gpt-zero-bubble", "deepseek-pp1"])
def test_tensor_parallel_pipeline_matches_one_process(results: list[dict], name: str) -> None:
    kind, pp = next((k, p) for n, k, p, *_ in RUNS if n == name)
    dp = WORLD // (pp * TP)
    ref_losses, ref_state = reference(kind, dp, M // dp)
    for rank, runs in enumerate(results):
        run = runs[name]
        want = ref_losses[run["dp"]]
        assert len(run["losses"]) == STEPS, (name, rank)
        for got, w in zip(run["losses"], want):
            assert abs(got - w) < 1e-5, (name, rank, run["losses"], want)
    full = results[0][name]["full"]
    assert set(full) == set(ref_state), (name, set(full) ^ set(ref_state))
    for key, want in ref_state.items():
        torch.testing.assert_close(full[key], want, rtol=1e-5, atol=1e-5, msg=f"{name} {key}")
    assert any(not torch.equal(full[k], v) for k, v in build(kind).state_dict().items())  # the steps moved it


def test_overlap_equals_sequential_and_sharding_changes_nothing_bitwise(results: list[dict]) -> None:
    assert_same_training(results, BITWISE)


@pytest.mark.parametrize("name", ["gpt", "qwen3", "deepseek"])
def test_each_rank_holds_its_heads_of_its_stage_and_sends_its_positions(results: list[dict], name: str) -> None:
    kind = next(k for n, k, *_ in RUNS if n == name)
    positions = SEQ[kind] - (1 if kind == "gpt" else 0)
    for rank, runs in enumerate(results):
        run = runs[name]
        assert run["meta"], rank  # the other stage's chunks
        assert run["projections"], rank
        for cls, placements, local, whole in run["projections"]:  # row-wise: each tp rank its heads' columns
            assert cls == "DTensor" and placements == ("S(1)",), (rank, run["projections"])
            assert local[1] * TP == whole[1] and local[0] == whole[0], (rank, local, whole)
        assert run["sent"], rank  # every rank holds a chunk that ends before the head (the first of its two)
        for cls, shape in run["sent"]:
            assert cls == "Tensor" and shape[1] == positions // TP, (rank, run["sent"])
