"""``benchmarks/fused_ce.py`` at a tiny shape, in this process: both variants run, give the same loss, and report a
peak and a time; the table puts them side by side with the ratios."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import fused_ce  # noqa: E402


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Requires: Linux /proc (host memory)")
def test_both_variants_run_and_agree() -> None:
    args = fused_ce.parse(["--tokens", "96", "--vocab", "500", "--hidden", "8", "--chunk", "64", "--repeat", "1"])
    rows = {}
    for variant in ("fused", "unfused"):
        args.variant = variant
        rows[variant] = fused_ce.run_variant(args)
        assert rows[variant]["peak_mib"] >= 0
    for variant, seconds in fused_ce.step_times(args, ["fused", "unfused"]).items():
        assert seconds > 0
        rows[variant]["step_s"] = seconds
    assert rows["fused"]["loss"] == pytest.approx(rows["unfused"]["loss"], rel=1e-6)
    text = fused_ce.table(args, rows)
    assert "fused / unfused: peak" in text and "96 tokens x 500 vocab" in text
