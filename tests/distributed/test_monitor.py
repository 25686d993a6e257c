"""``MoEMonitor`` and ``OverlapTimeline`` in the README example on 4 gloo ranks: the CSV columns, their values
against an independent count of the routing, and the timeline of an overlapped step."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger

from lightning_moe_overlap import MoEMonitor, MoEOverlapStrategy, OverlapTimeline
from lightning_moe_overlap.demo import MoEGPT, SyntheticTokens
from lightning_moe_overlap.overlap.timeline import timelines_from_trace
from tests.helpers.distributed import run_distributed
from tests.helpers.records import record_routing

WORLD, EP, MICRO, STEPS, EVERY, BATCH, SEQ, TOP_K, EXPERTS, CAPACITY = 4, 2, 2, 4, 2, 8, 32, 2, 8, 1.0


def _worker(rank: int, world: int, root: str) -> dict:
    torch.manual_seed(0)
    model = MoEGPT(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, num_experts=EXPERTS, top_k=TOP_K,
                   ffn_hidden_size=32)
    routed = record_routing(model)  # the independent count: every training forward's indices
    trainer = Trainer(
        accelerator="cpu", devices=world, max_steps=STEPS, log_every_n_steps=EVERY, limit_val_batches=0,
        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False, num_sanity_val_steps=0,
        logger=CSVLogger(root, name="csv", version=0),
        strategy=MoEOverlapStrategy(ep=EP, num_microbatches=MICRO, delay_wgrad=True, capacity_factor=CAPACITY),
        callbacks=[MoEMonitor(), OverlapTimeline(step=2, dirpath=f"{root}/timeline")],
    )
    trainer.fit(model, datamodule=SyntheticTokens(vocab_size=128, seq_len=SEQ, batch_size=BATCH))
    # The last interval: the forwards of the last EVERY steps (MICRO per step).
    last = {i: torch.cat(v[-EVERY * MICRO :]) for i, v in routed.items()}
    per_call = {i: v[-EVERY * MICRO :] for i, v in routed.items()}
    counts = {i: torch.bincount(v.reshape(-1), minlength=EXPERTS).tolist() for i, v in last.items()}
    capacity = math.ceil(BATCH // MICRO * SEQ * TOP_K / EXPERTS * CAPACITY)
    dropped = {
        i: sum(int((torch.bincount(c.reshape(-1), minlength=EXPERTS) - capacity).clamp(min=0).sum()) for c in calls)
        for i, calls in per_call.items()
    }
    return {"counts": counts, "dropped": dropped, "tokens": sum(c.shape[0] for c in per_call[0])}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[list[dict], Path]:  # noqa: ANN001
    root = tmp_path_factory.mktemp("monitor")
    return run_distributed(_worker, WORLD, str(root), timeout_s=240), root


def _last_row(root: Path) -> dict[str, float]:
    rows = list(csv.DictReader(open(root / "csv" / "version_0" / "metrics.csv")))
    logged = [r for r in rows if r.get("moe/aux_loss")]
    assert [int(r["step"]) for r in logged] == [EVERY - 1, 2 * EVERY - 1]  # respects log_every_n_steps
    return {k: float(v) for k, v in logged[-1].items() if v != ""}


def test_csv_has_the_metrics(run) -> None:  # noqa: ANN001
    row = _last_row(run[1])
    for layer in ("layers.0.mlp", "layers.1.mlp"):
        for metric in ("aux_loss", "tokens_per_expert_min", "tokens_per_expert_max", "tokens_per_expert_cv",
                       "imbalance", "dropped_fraction"):
            assert f"moe/{layer}/{metric}" in row, metric
    for metric in ("aux_loss", "imbalance", "imbalance_max", "dropped_fraction", "a2a_exposed_ms",
                   "a2a_total_ms", "a2a_hidden_fraction", "microbatches", "tokens_per_s"):
        assert f"moe/{metric}" in row, metric
    # MoEGPT's routers have no z-loss coefficient: no z-loss is computed, so none is logged (not a 0.0)
    assert not [name for name in row if name.endswith("z_loss")]
    assert row["moe/microbatches"] == MICRO
    assert 0 <= row["moe/a2a_exposed_ms"] <= row["moe/a2a_total_ms"]
    assert 0 <= row["moe/a2a_hidden_fraction"] <= 1
    assert row["moe/tokens_per_s"] > 0
    assert row["moe/aux_loss"] == pytest.approx(row["moe/layers.0.mlp/aux_loss"] + row["moe/layers.1.mlp/aux_loss"])


def test_values_match_an_independent_count(run) -> None:  # noqa: ANN001
    results, root = run
    row = _last_row(root)
    # ep=2 x dp=4: each rank routes its own tokens; the monitor sums all ranks, per step.
    tokens_per_step = sum(r["tokens"] for r in results) / EVERY
    assert tokens_per_step == WORLD * BATCH * SEQ
    for i in (0, 1):
        counts = [sum(r["counts"][i][e] for r in results) / EVERY for e in range(EXPERTS)]
        assert sum(counts) == tokens_per_step * TOP_K  # every token routed to top_k experts
        prefix = f"moe/layers.{i}.mlp"
        mean = sum(counts) / EXPERTS
        assert row[f"{prefix}/tokens_per_expert_min"] == pytest.approx(min(counts))
        assert row[f"{prefix}/tokens_per_expert_max"] == pytest.approx(max(counts))
        assert row[f"{prefix}/imbalance"] == pytest.approx(max(counts) / mean)
        std = math.sqrt(sum((c - mean) ** 2 for c in counts) / EXPERTS)
        assert row[f"{prefix}/tokens_per_expert_cv"] == pytest.approx(std / mean)
        dropped = sum(r["dropped"][i] for r in results)
        assert row[f"{prefix}/dropped_fraction"] == pytest.approx(dropped / (tokens_per_step * TOP_K * EVERY))


def test_timeline_of_an_overlapped_step(run) -> None:  # noqa: ANN001
    folder = run[1] / "timeline"
    trace = json.loads((folder / "step2.trace.json").read_text())
    timelines = timelines_from_trace(trace)
    assert [t.rank for t in timelines] == list(range(WORLD))
    for t in timelines:
        order = [r.task for r in sorted(t.runs, key=lambda r: r.start) if r.task in ("F1", "B0")]
        assert order[0] == "B0" and sum(a != b for a, b in zip(order, order[1:])) >= 3, order
        assert all(0 <= c.exposed <= c.in_flight + 1e-9 for c in t.comms)
        assert {c.task for c in t.comms} == {"F0", "F1", "B0", "B1"}
    if importlib.util.find_spec("matplotlib") is not None:
        assert (folder / "step2.png").read_bytes()[:4] == b"\x89PNG"
