"""A configuration that breaks several rules reports all of them in one error, the pipeline rules included.

Oracle: the rules each configuration breaks, written out by hand from docs/validation.md and the schedule table of
``pipeline/schedules.py``; the error must list each of them, numbered, and say how many there are.
"""

from __future__ import annotations

import pytest

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.config import OverlapConfig
from lightning_moe_overlap.pipeline.schedules import schedule_problems, validate_schedule
from lightning_moe_overlap.validation import check_config


def test_a_microbatch_count_and_overlap_at_pp2_are_reported_together():
    with pytest.raises(ValueError, match=r"(?s)2 problems:.*1\. .*needs num_microbatches a multiple of pp, got 3 "
                       r"micro-batches and pp=2.*2\. .*Overlap with `zero_bubble`"):
        MoEOverlapStrategy(pp=2, vpp=2, pipeline_schedule="zero_bubble", overlap=True, num_microbatches=3)


def test_layout_schedule_and_tp_rules_are_reported_together():
    cfg = OverlapConfig(pp=2, vpp=3, pipeline_layout="E|t|t|tL", num_microbatches=3, tp=2, sequence_parallel=False)
    messages = [p.message for p in check_config(cfg) if p.is_error]
    assert len(messages) == 3, messages
    assert "has 4 chunks; it needs pp * vpp = 6" in messages[0]
    assert "needs num_microbatches a multiple of pp, got 3" in messages[1]
    assert "`tp=2` with `sequence_parallel=False`" in messages[2]
    with pytest.raises(ValueError, match=r"(?s)3 problems:.*has 4 chunks.*a multiple of pp.*sequence_parallel=False"):
        MoEOverlapStrategy(pp=2, vpp=3, pipeline_layout="E|t|t|tL", num_microbatches=3, tp=2, sequence_parallel=False)


def test_every_schedule_rule_at_once():
    found = schedule_problems("zero_bubble", pp=2, vpp=1, num_microbatches=3, overlap=True)
    assert [type(e) for e in found] == [ValueError, ValueError, NotImplementedError]
    assert "Set vpp >= 2" in str(found[0])
    assert "Use 2 or 4 micro-batches" in str(found[1])
    assert "no pair of a forward and a full backward" in str(found[2])
    assert schedule_problems("dualpipev", pp=2, vpp=2, num_microbatches=4, overlap=True) == []


def test_validate_schedule_still_raises_the_first():
    with pytest.raises(ValueError, match=r"interleaves virtual stages, got vpp=1\. Set vpp >= 2"):
        validate_schedule("zero_bubble", pp=2, vpp=1, num_microbatches=3, overlap=True)


def test_unparsable_layout_is_reported_with_the_other_rules():
    cfg = OverlapConfig(pp=2, pipeline_layout="Et)|tL", delay_wgrad=True, tp=2, sequence_parallel=False)
    rules = [p.rule for p in check_config(cfg) if p.is_error]
    assert rules == ["pipeline-layout", "tp-sequence-parallel"], rules
