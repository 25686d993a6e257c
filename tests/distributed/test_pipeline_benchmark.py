"""``benchmarks/overlap.py --pp 2 --vpp 2`` end to end at a tiny shape: 4 gloo ranks (pp=2 x dp=2, ep=2), one
measured step per mode after one warm-up step (the first step also infers the stages' shapes), both modes in one spawn.

Oracles independent of the script's arithmetic: the parameters end bitwise equal with overlap on and off; each rank
waits on 5 all-to-alls per block and micro-batch (count exchange, dispatch, combine forward; dispatch, combine
backward) in both modes; it runs one forward and one full backward per held stage and micro-batch; and the idle
slots of torch's interleaved 1F1B order at pp=2, vpp=2, M=4 are those drawn in docs/pipeline.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import overlap as bench  # noqa: E402

M, LAYERS, VPP = 4, 4, 2  # one block per chunk, two chunks per rank


@pytest.mark.long  # a benchmark script end to end, 4 processes
def test_pipeline_benchmark_reports_bubble_and_exposed_all_to_all_per_rank() -> None:
    cfg, _ = bench.parse_args([
        "--ranks", "4", "--pp", "2", "--vpp", str(VPP), "--layers", str(LAYERS), "--hidden", "16", "--ffn", "8",
        "--dense-ffn", "8", "--tokens", "8", "--microbatches", str(M), "--steps", "1", "--warmup", "1",
    ])
    summary = bench.summarise(bench.launch(cfg), cfg)
    assert summary["bitwise_equal"] is True
    modes = summary["modes"]
    assert list(modes) == ["sequential", "overlap"] and modes["sequential"]["ratio"] == 1.0
    assert modes["overlap"]["ratio"] > 0
    # (idle slots, slots) per pp rank; the pairs shorten the rows of the overlapped order.
    slots = {"sequential": {0: (6, 22), 1: (6, 22)}, "overlap": {0: (6, 18), 1: (7, 18)}}
    blocks_per_rank = LAYERS // 2
    for mode, values in modes.items():
        for rank, r in enumerate(values["ranks"]):
            pp_rank = r["coords"]["pp"]
            assert r["stages"] == [pp_rank, pp_rank + 2], (mode, rank)
            assert r["waits"] == blocks_per_rank * M * 5, (mode, rank, r["waits"])
            assert r["actions"] == 2 * VPP * M, (mode, rank, r["actions"])
            assert (r["idle_slots"], r["slots"]) == slots[mode][pp_rank], (mode, rank)
            assert 0 < r["busy_s"] < r["schedule_s"] and 0 < r["bubble"] < 1, (mode, rank, r)
            assert 0 <= r["blocked_s"] < r["schedule_s"], (mode, rank, r)
        assert all(1.0 <= c <= 2.0 for c in values["concurrency"]) and len(values["concurrency"]) == 2, values
    assert "0F2|2B0" in summary["orders"]["overlap"]
    bench.print_summary(summary)  # the table prints from the JSON-able summary
