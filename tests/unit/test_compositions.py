"""Which settings a large run combines compose: every option alone and every pair of them, constructed as a user
would (``OverlapConfig`` through every validation rule, as ``MoEOverlapStrategy(...)`` and ``check`` run them).

The pairs still refused are exactly the ones docs/validation.md ("What composes") lists, each with its rule; a
change that refuses another pair, or lifts one of these, fails here until the list and the docs say so.
"""

from __future__ import annotations

import itertools
import warnings

import pytest

from lightning_moe_overlap.config import OverlapConfig
from lightning_moe_overlap.validation import check_config

OPTIONS = {
    "ep": {"ep": 2},
    "tp": {"tp": 2},
    "cp": {"cp": 2},
    "pp": {"pp": 2, "vpp": 2, "num_microbatches": 4},
    "shard_optimizer": {"shard": "optimizer"},
    "shard_full": {"shard": "full"},
    "fp8": {"fp8": "tensorwise"},
    "delay_wgrad": {"delay_wgrad": True},
    "overlap_grad_reduce": {"shard": "full", "overlap_grad_reduce": True},
    "optimizer_offload": {"optimizer_cpu_offload": True},
    "dedup": {"alltoall_dedup": True},
    "static": {"alltoall_static": True},
    "compile": {"compile": True},
}
STILL_REFUSED: dict[tuple[str, str], str] = {  # (pair): the rule that refuses it (docs/validation.md, "What composes")
    ("fp8", "static"): "alltoall-static",  # FP8 rows are scaled in blocks sized on the host
    ("dedup", "static"): "alltoall-static",  # one row per (token, rank), sized on the host
}


def _refusing_rules(settings: dict) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sorted(p.rule for p in check_config(OverlapConfig(**settings)) if p.is_error)


def _pairs() -> list[tuple[str, str]]:
    """Every pair of options that can be set together (not two values of one setting)."""
    return [
        (a, b) for a, b in itertools.combinations(OPTIONS, 2)
        if not any(k in OPTIONS[b] and OPTIONS[b][k] != v for k, v in OPTIONS[a].items())
    ]  # fmt: skip


@pytest.mark.parametrize("name", list(OPTIONS))
def test_every_option_alone_is_accepted(name: str) -> None:
    assert _refusing_rules(OPTIONS[name]) == []


def test_the_pairs_refused_are_exactly_the_documented_ones() -> None:
    refused = {pair: _refusing_rules({**OPTIONS[pair[0]], **OPTIONS[pair[1]]}) for pair in _pairs()}
    refused = {pair: rules for pair, rules in refused.items() if rules}
    assert refused == {pair: [rule] for pair, rule in STILL_REFUSED.items()}
    assert len(_pairs()) == 76  # 78 pairs of 13 options, less shard_optimizer with shard_full / overlap_grad_reduce


def test_the_docs_list_the_refused_pairs() -> None:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "validation.md").read_text()
    section = text.split("## What composes", 1)[1].split("\n## ", 1)[0]
    for rule in STILL_REFUSED.values():
        assert f"`{rule}`" in section, rule
    if not STILL_REFUSED:
        assert "every pair composes" in section
