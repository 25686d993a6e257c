"""``MoEMonitor``'s TensorBoard histograms on 2 gloo ranks: each step's tokens-per-expert histogram lands at the step
of that step's scalars and holds that step's counts, checked against the routing the routers returned."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_moe_overlap import MoEMonitor, MoEOverlapStrategy
from lightning_moe_overlap.demo import MoEGPT, SyntheticTokens
from tests.helpers.distributed import run_distributed
from tests.helpers.records import record_routing

pytest.importorskip("tensorboard", reason="Requires: tensorboard (`pip install -e '.[loggers]'`)")

WORLD, EP, MICRO, STEPS, BATCH, SEQ, TOP_K, EXPERTS, LAYERS = 2, 2, 2, 3, 4, 8, 2, 4, 2
BLOCKS = [f"layers.{i}.mlp" for i in range(LAYERS)]


def _worker(rank: int, world: int, root: str) -> dict[int, list[list[int]]]:
    from lightning.pytorch.loggers import TensorBoardLogger

    torch.manual_seed(0)
    model = MoEGPT(vocab_size=64, hidden_size=16, num_layers=LAYERS, num_heads=2, num_experts=EXPERTS, top_k=TOP_K,
                   ffn_hidden_size=16)
    routed = record_routing(model)  # the independent count: every training forward's indices
    trainer = Trainer(
        accelerator="cpu", devices=world, max_steps=STEPS, log_every_n_steps=1, limit_val_batches=0,
        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False, num_sanity_val_steps=0,
        logger=TensorBoardLogger(root, name="tb", version=0),
        strategy=MoEOverlapStrategy(ep=EP, num_microbatches=MICRO),
        callbacks=[MoEMonitor()],
    )
    trainer.fit(model, datamodule=SyntheticTokens(vocab_size=64, seq_len=SEQ, batch_size=BATCH))
    assert all(len(calls) == STEPS * MICRO for calls in routed.values())  # MICRO training forwards per step
    return {  # this rank's tokens per expert of each step (its MICRO forwards)
        i: [torch.bincount(torch.cat(calls[s * MICRO : (s + 1) * MICRO]).reshape(-1), minlength=EXPERTS).tolist()
            for s in range(STEPS)]
        for i, calls in routed.items()
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[list[dict], Path]:  # noqa: ANN001
    root = tmp_path_factory.mktemp("monitor_tb")
    return run_distributed(_worker, WORLD, str(root), timeout_s=240), root


def _events(root: Path):  # noqa: ANN202
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(root / "tb" / "version_0"), size_guidance={"histograms": 0, "scalars": 0})
    return events.Reload()


def test_histograms_share_the_step_of_their_scalars(run) -> None:  # noqa: ANN001
    events = _events(run[1])
    for block in BLOCKS:
        scalar_steps = [e.step for e in events.Scalars(f"moe/{block}/tokens_per_expert_max")]
        histogram_steps = [e.step for e in events.Histograms(f"moe/{block}/tokens_per_expert")]
        assert scalar_steps == histogram_steps == list(range(STEPS)), block


def test_each_histogram_holds_the_counts_of_its_step(run) -> None:  # noqa: ANN001
    results, root = run
    events = _events(root)
    for i, block in enumerate(BLOCKS):
        maxima = {e.step: e.value for e in events.Scalars(f"moe/{block}/tokens_per_expert_max")}
        for event in events.Histograms(f"moe/{block}/tokens_per_expert"):
            # ep=2 x dp=2: each rank routes its own tokens; the monitor sums the ranks
            expected = [sum(r[i][event.step][e] for r in results) for e in range(EXPERTS)]
            assert sum(expected) == WORLD * BATCH * SEQ * TOP_K
            assert list(event.histogram_value.bucket) == expected, (block, event.step)
            assert maxima[event.step] == pytest.approx(max(expected))
