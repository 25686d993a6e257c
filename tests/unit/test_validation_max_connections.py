"""Overlap at pp > 1 on CUDA with ``CUDA_DEVICE_MAX_CONNECTIONS=1`` is refused before anything starts."""

from __future__ import annotations

import pytest

from lightning_moe_overlap.config import OverlapConfig
from lightning_moe_overlap.validation import check_machine, raise_problems

PP2 = {"pp": 2, "num_microbatches": 4, "pipeline_schedule": "interleaved_1f1b", "vpp": 2}


def rules(cfg: OverlapConfig, device_type: str) -> list[str]:
    return [p.rule for p in check_machine(cfg, device_type, cuda_available=True)]


def test_overlap_at_pp2_with_one_connection_is_refused_on_cuda(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with pytest.raises(
        NotImplementedError,
        match=r"overlap=True at pp=2 with CUDA_DEVICE_MAX_CONNECTIONS=1.*different orders on different ranks.*"
        r"Set CUDA_DEVICE_MAX_CONNECTIONS=32 \(or unset it\).*or use overlap=False at pp > 1",
    ):
        raise_problems(check_machine(OverlapConfig(overlap=True, **PP2), "cuda", cuda_available=True))


@pytest.mark.parametrize("value", [None, "32", "8"])
def test_other_connection_counts_pass(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    else:
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", value)
    assert "overlap-pp-max-connections" not in rules(OverlapConfig(overlap=True, **PP2), "cuda")


def test_only_overlap_at_pp_above_one_on_cuda_is_refused(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    assert "overlap-pp-max-connections" not in rules(OverlapConfig(overlap=False, **PP2), "cuda")
    assert "overlap-pp-max-connections" not in rules(OverlapConfig(overlap=True, num_microbatches=2), "cuda")
    assert "overlap-pp-max-connections" not in rules(OverlapConfig(overlap=True, **PP2), "cpu")
