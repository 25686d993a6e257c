"""``apply_fp8``: what it converts and leaves out (with reasons), that parameters and state-dict keys stay, dense
linears through torchao in FP8, and every refusal with its rule and fix."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.fp8 import RECIPES, Float8ExpertsKernel, apply_fp8, has_fp8_kernel
from lightning_moe_overlap.moe import ExpertParallelExperts, Experts, layout_of
from lightning_moe_overlap.moe.dispatch import AllToAllDispatcher
from tests.unit.test_fp8_gemm import FORWARD_DB, sqnr_db


def _gpt() -> MoEGPT:
    return MoEGPT(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_experts=4, ffn_hidden_size=32)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_moegpt_converts_attention_and_experts_keeps_head_and_state_dict(recipe: str) -> None:
    model = _gpt()
    before = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    report = apply_fp8(model, recipe)
    assert report.recipe is RECIPES[recipe]
    assert set(report.linears) == {f"layers.{i}.attn.{n}" for i in range(2) for n in ("qkv", "proj")}
    assert report.experts == ("layers.0.mlp.experts", "layers.1.mlp.experts")
    assert list(report.skipped) == ["head"] and "output heads and routers" in report.skipped["head"]
    assert type(model.layers[0].attn.qkv).__name__ == "Float8Linear" and type(model.head) is nn.Linear
    assert all(has_fp8_kernel(layer.mlp.experts) for layer in model.layers)
    assert {k: (v.shape, v.dtype) for k, v in model.state_dict().items()} == before  # masters and keys unchanged
    assert "FP8 " + recipe in str(report) and "kept in high precision: head" in str(report)


def test_dense_linear_runs_in_fp8_through_torchao() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 64, bias=False))
    reference = nn.Linear(128, 64, bias=False)
    reference.weight.data.copy_(model[0].weight)
    apply_fp8(model, "tensorwise", experts=False)
    x = torch.randn(256, 128)
    out, out_ref = model(x), reference(x)
    assert not torch.equal(out, out_ref) and sqnr_db(out_ref, out) >= FORWARD_DB


def test_linears_with_dims_off_16_and_filtered_ones_stay_with_their_reasons() -> None:
    model = nn.ModuleDict(
        {"odd": nn.Linear(24, 32), "ok": nn.Linear(32, 48), "router": nn.Linear(32, 16), "mine": nn.Linear(16, 16)}
    )
    report = apply_fp8(model, "rowwise", module_filter=lambda fqn, m: fqn != "mine")
    assert report.linears == ("ok", "router")  # a custom filter replaces the default (which leaves routers out)
    assert report.skipped["odd"] == "in_features=24, out_features=32: FP8 GEMMs need both to be multiples of 16"
    assert report.skipped["mine"].startswith("left out by the filter")
    assert apply_fp8(nn.ModuleDict({"router": nn.Linear(32, 16)})).skipped.keys() == {"router"}


def test_experts_with_dims_off_16_stay_with_the_reason() -> None:
    model = nn.ModuleDict({"experts": Experts(4, 24, 32)})
    report = apply_fp8(model, dense=False)
    assert report.experts == () and model["experts"].kernel is None
    assert report.skipped == {"experts": "expert weight dims [24, 32, 64]: FP8 GEMMs need multiples of 16"}


def test_dense_false_converts_no_linear_and_needs_no_torchao(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # importing it now raises ImportError
    model = _gpt()
    report = apply_fp8(model, "tensorwise", dense=False)
    assert report.linears == () and len(report.experts) == 2 and type(model.layers[0].attn.qkv) is nn.Linear
    with pytest.raises(ImportError, match=r"torchao's float8 training.*not installed.*\[fp8\].*dense=False"):
        apply_fp8(_gpt(), "tensorwise")


def test_refusals_name_the_values_the_rule_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"recipe='fp4' is not a known recipe"):
        apply_fp8(_gpt(), "fp4")
    with pytest.raises(NotImplementedError, match=r"recipe='delayed' on device 'cpu'"):
        apply_fp8(_gpt(), "delayed")
    with pytest.raises(TypeError, match=r"hold \['torch.float64'\] weights.*float32, bfloat16 or float16"):
        apply_fp8(nn.ModuleDict({"e": Experts(4, 16, 16, dtype=torch.float64)}), dense=False)
    custom = RECIPES["rowwise"].__class__("mine", "row", torch.float8_e4m3fn, torch.float8_e5m2, False)
    with pytest.raises(ValueError, match=r"dense linears run torchao's named recipes"):
        apply_fp8(nn.Sequential(nn.Linear(16, 16)), custom)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(NotImplementedError, match=r"compute capability \(8, 0\), but FP8 GEMMs need \(8, 9\)"):
        apply_fp8(_gpt(), "tensorwise", device="cuda")


def test_te_experts_are_refused_with_the_fix() -> None:
    source = Experts(4, 16, 16)
    wrapped = ExpertParallelExperts(source, layout_of(source), AllToAllDispatcher(None, 4, None), expert_backend="te")
    with pytest.raises(NotImplementedError, match=r"'e' run on `expert_backend='te'`.*Use `expert_backend='torch'`"):
        apply_fp8(nn.ModuleDict({"e": wrapped}), dense=False)
    assert not isinstance(wrapped.kernel, Float8ExpertsKernel)
