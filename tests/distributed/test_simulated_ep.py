"""Simulated expert parallelism on CPU (the CI twin of ``tests/gpu/test_simulated_ep.py``): one gloo rank, every
all-to-all a thread-based loopback of known duration, ``benchmarks/overlap.py --simulate-ep`` run in process for
two steps per mode; overlapped and sequential training end bitwise equal, with and without the all-to-all
dispatcher's deduplicated dispatch, which sends fewer bytes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import overlap as bench  # noqa: E402


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_simulated_ep_overlap_bitwise_equal_to_sequential(one_rank_group: None, tmp_path: Path) -> None:
    trace = tmp_path / "step.json"
    cfg, _ = bench.parse_args([
        "--simulate-ep", "2", "--layers", "2", "--hidden", "32", "--ffn", "16", "--dense-ffn", "16",
        "--tokens", "16", "--microbatches", "3", "--steps", "1", "--warmup", "1", "--trace", str(trace), "--compare-dedup",
    ])
    assert (cfg.ranks, cfg.ep, cfg.simulate_ep_ms) == (1, 1, 2.0)
    result = bench.rank_main(0, cfg)
    assert result["bitwise_equal"] is True
    for mode, records in result["records"].items():
        # 2 layers x 3 micro-batches x (count exchange + dispatch + combine) forward, dispatch + combine backward
        assert records[0]["waits"] == 2 * 3 * 5, mode
    summary = bench.summarise([result], cfg)
    assert summary["comm_s"] == pytest.approx(2 * 3 * 5 * 0.002)
    assert summary["simulated"]["host_syncs_per_step"] is None  # counted on CUDA only
    assert summary["simulated"]["trace"] == str(trace) and json.loads(trace.read_text())["traceEvents"]
    # Top-2 on one (simulated) rank: every token once instead of twice, plus its weights and expert indices.
    sent = {mode: summary["modes"][mode]["remote_bytes"] for mode in ("sequential", "sequential/plain")}
    assert 0 < sent["sequential"] < 0.6 * sent["sequential/plain"], sent
    assert summary["dedup"]["bytes"] == sent["sequential"] / sent["sequential/plain"]


def test_thread_loopback_copies_after_the_wait() -> None:
    from lightning_moe_overlap.moe.dispatch.loopback import Loopback

    inp, out = torch.arange(6.0).view(3, 2), torch.zeros(3, 2)
    work = Loopback(0.01)(out, inp)
    assert work.wait() is True and torch.equal(out, inp)


def test_loopback_rejects_a_negative_duration() -> None:
    from lightning_moe_overlap.moe.dispatch.loopback import Loopback

    with pytest.raises(ValueError, match=r"comm_s=-1.*must be >= 0"):
        Loopback(-1)
