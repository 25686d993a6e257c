"""The FP8 rules (``validation.check_fp8*``): every problem with its rule id, its kind and its fix, and the strategy
raising them from its constructor."""

from __future__ import annotations

import pytest

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.config import OverlapConfig
from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.validation import check_fp8, check_fp8_machine, check_fp8_model


def _rules(problems) -> list[tuple[str, str]]:
    return [(p.rule, p.error.__name__ if p.error else "warning") for p in problems]


def test_no_fp8_and_a_plain_fp8_config_have_no_problem() -> None:
    assert check_fp8(None, OverlapConfig(ep=2)) == []
    assert check_fp8("rowwise", OverlapConfig(ep=2)) == check_fp8("tensorwise", OverlapConfig()) == []
    # the deduplicated all-to-all sends its rows in FP8 too (tests/unit/test_fp8_dispatch.py)
    assert check_fp8("rowwise", OverlapConfig(ep=2, alltoall_dedup=True)) == []
    # FP8 over a tensor-parallel plan (tests/distributed/test_fp8_tensor_parallel.py)
    assert check_fp8("tensorwise", OverlapConfig(tp=2, ep=2)) == check_fp8("rowwise", OverlapConfig(tp=2)) == []
    # FP8 over pipeline chunks (tests/distributed/test_fp8_pipeline.py)
    assert check_fp8("rowwise", OverlapConfig(pp=2, vpp=2, ep=2)) == check_fp8("tensorwise", OverlapConfig(pp=2)) == []


@pytest.mark.parametrize(
    ("fp8", "cfg", "expected", "fix"),
    [
        ("bogus", {}, ("fp8-recipe", "ValueError"), r"Pass `fp8='rowwise'` or `fp8='tensorwise'`"),
        (8, {}, ("fp8-recipe", "ValueError"), r"one of \['tensorwise', 'rowwise', 'mxfp8'\] or None"),
        ("delayed", {}, ("fp8-needs-te", "NotImplementedError"), r"Transformer Engine.*Use `fp8='rowwise'`"),
        ("rowwise", {"expert_backend": "te"}, ("fp8-te-experts", "NotImplementedError"), r"Use `expert_backend='torch'`"),
        ("rowwise", {"dispatcher": "allgather"}, ("fp8-dispatch-high-precision", "warning"), r"only `dispatcher='alltoall'`"),
    ],
)
def test_each_fp8_rule(fp8, cfg, expected, fix) -> None:
    problems = check_fp8(fp8, OverlapConfig(**cfg))
    assert _rules(problems) == [expected]
    assert __import__("re").search(fix, problems[0].message), problems[0].message


def test_the_strategy_raises_the_fp8_errors_and_warns_the_rest() -> None:
    with pytest.raises(ValueError, match=r"`fp8='bogus'` is not an FP8 recipe"):
        MoEOverlapStrategy(fp8="bogus")
    with pytest.raises(NotImplementedError, match=r"`fp8='rowwise'` with `expert_backend='te'`"):
        MoEOverlapStrategy(fp8="rowwise", expert_backend="te")
    with pytest.warns(UserWarning, match=r"dispatched in high precision"):
        strategy = MoEOverlapStrategy(fp8="rowwise", dispatcher="allgather")
    assert strategy.config.fp8 == "rowwise" and strategy.fp8_report is None  # converted in setup


def test_machine_rules() -> None:
    assert check_fp8_machine(None, "cpu", torchao=False) == []
    assert check_fp8_machine("rowwise", "cpu", torchao=True) == []
    assert _rules(check_fp8_machine("rowwise", "cpu", torchao=False)) == [("fp8-needs-torchao", "ImportError")]
    problems = check_fp8_machine("tensorwise", "cuda", cuda_capability=(8, 0), torchao=True)
    assert _rules(problems) == [("fp8-gpu", "NotImplementedError")] and "(8, 9) or newer" in problems[0].message
    assert check_fp8_machine("tensorwise", "cuda", cuda_capability=(9, 0), torchao=True) == []


def test_dims_not_multiple_of_16_are_one_warning_naming_the_layers() -> None:
    aligned = MoEGPT(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_experts=4, ffn_hidden_size=32)
    assert check_fp8_model("rowwise", aligned) == [] and check_fp8_model(None, aligned) == []
    odd = MoEGPT(vocab_size=64, hidden_size=40, num_layers=1, num_heads=4, num_experts=4, ffn_hidden_size=32)
    problems = check_fp8_model("rowwise", odd)
    assert _rules(problems) == [("fp8-dims", "warning")]
    for name in ("layers.0.attn.qkv", "layers.0.attn.proj", "layers.0.mlp.experts"):
        assert name in problems[0].message
    assert "Pad those dims to multiples of 16" in problems[0].message


def test_fp8_and_config_errors_come_in_one_error() -> None:
    with pytest.raises(ValueError, match=r"(?s)2 problems:.*1\. .*num_microbatches.*2\. .*`fp8='bogus'`"):
        MoEOverlapStrategy(fp8="bogus", num_microbatches=0)
