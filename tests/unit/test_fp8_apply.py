"""``apply_fp8``: what it converts and leaves out (with reasons), that parameters and state-dict keys stay, dense
linears through torchao in FP8, and every refusal with its rule and fix."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.demo_hf import HFMoECausalLM
from lightning_moe_overlap.fp8 import RECIPES, Float8ExpertsKernel, apply_fp8, has_fp8_kernel
from lightning_moe_overlap.config import OverlapConfig
from lightning_moe_overlap.fp8.dense import HIGH_PRECISION_ATTR
from lightning_moe_overlap.parallelize.steps import apply_fp8_step
from lightning_moe_overlap.moe import ExpertParallelExperts, Experts, apply_expert_parallel, layout_of
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
    fp8_linear = "MXLinear" if recipe == "mxfp8" else "Float8Linear"  # torchao's MX linear, or its float8 one
    assert type(model.layers[0].attn.qkv).__name__ == fp8_linear and type(model.head) is nn.Linear
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


def test_a_linear_its_model_marks_stays_in_high_precision_with_the_models_reason() -> None:
    model = nn.ModuleDict({"fused": nn.Linear(32, 96), "ok": nn.Linear(32, 32)})
    setattr(model["fused"], HIGH_PRECISION_ATTR, "computed outside its forward")
    report = apply_fp8(model, "tensorwise")
    assert report.linears == ("ok",) and report.skipped == {"fused": "computed outside its forward"}
    assert type(model["fused"]) is nn.Linear and type(model["ok"]).__name__ == "Float8Linear"


def test_moegpt_marks_its_fused_qkv_only_under_a_tensor_parallel_plan() -> None:
    model = MoEGPT(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_experts=4, ffn_hidden_size=32)
    assert not hasattr(model.layers[0].attn.qkv, HIGH_PRECISION_ATTR)
    mesh = type("Mesh", (), {"size": lambda self: 2})()  # the plan reads only the mesh's size here
    model.tensor_parallel_plan(mesh)
    report = apply_fp8(model, "tensorwise")
    assert "fused qkv at tp > 1" in report.skipped["layers.0.attn.qkv"]
    assert report.linears == ("layers.0.attn.proj",)


def test_float8_all_gather_wraps_the_weights_for_tensorwise_and_refuses_rowwise() -> None:
    model = nn.ModuleDict({"ok": nn.Linear(32, 32)})
    report = apply_fp8(model, "tensorwise", float8_all_gather=True)
    assert report.float8_all_gather and "all-gathered in float8" in str(report)
    assert type(model["ok"].weight).__name__ == "WeightWithDynamicFloat8CastTensor"
    with pytest.raises(ValueError, match=r"float8_all_gather=True with recipe 'rowwise'.*Use recipe='tensorwise'"):
        apply_fp8(nn.ModuleDict({"ok": nn.Linear(32, 32)}), "rowwise", float8_all_gather=True)
    assert not apply_fp8(nn.ModuleDict({"ok": nn.Linear(32, 32)}), "tensorwise").float8_all_gather


@pytest.mark.parametrize(
    ("recipe", "cfg", "expected"),
    [
        ("tensorwise", {"shard": "full"}, True),
        ("tensorwise", {"shard": "full", "tp": 2}, False),  # a tp DTensor weight: not wrapped (docs/fp8.md)
        ("rowwise", {"shard": "full"}, False),
        ("tensorwise", {"shard": "optimizer"}, False),
        ("tensorwise", {}, False),
    ],
)
def test_the_strategy_step_all_gathers_in_float8_only_at_shard_full_tensorwise_tp1(recipe, cfg, expected) -> None:
    report = apply_fp8_step(nn.ModuleDict({"ok": nn.Linear(32, 32)}), recipe, torch.device("cpu"), OverlapConfig(**cfg))
    assert report is not None and report.float8_all_gather is expected


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


def test_hugging_face_experts_not_yet_expert_parallel_are_reported_with_the_fix() -> None:
    plain = HFMoECausalLM("qwen3_moe")
    report = apply_fp8(plain, "rowwise")
    hf_experts = [n for n, m in plain.named_modules() if n.endswith("mlp.experts")]
    assert report.experts == () and len(hf_experts) == 2
    for name in hf_experts:
        assert "call `apply_expert_parallel` first" in report.skipped[name]
        assert not has_fp8_kernel(plain.get_submodule(name))
    wrapped = HFMoECausalLM("qwen3_moe")
    apply_expert_parallel(wrapped, None)
    report = apply_fp8(wrapped, "rowwise")
    assert report.experts == tuple(hf_experts) and not set(hf_experts) & set(report.skipped)
    with torch.device("meta"):  # another pipeline rank's chunk: not this rank's to report
        on_meta = HFMoECausalLM("qwen3_moe")
    assert not set(hf_experts) & set(apply_fp8(on_meta, "rowwise", dense=False).skipped)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_dense_linears_meet_cudas_fp8_gemm_rule_at_any_token_count(recipe: str, monkeypatch) -> None:
    """CUDA's ``_scaled_mm`` wants the contraction (``mat1``'s columns, ``mat2``'s rows) and ``mat2``'s columns in
    multiples of 16; torch's CPU kernel does not check it, so the rule is applied here around it. The weight
    gradient contracts over the tokens: 9 tokens (an odd sequence, a cp shard, a short batch) must still pass, with
    the gradients of the unpadded product."""
    real, shapes = torch._scaled_mm, []

    def cuda_rule(mat1, mat2, *args, **kwargs):
        shapes.append((tuple(mat1.shape), tuple(mat2.shape)))
        assert mat1.shape[1] % 16 == 0 and mat2.shape[0] % 16 == 0 and mat2.shape[1] % 16 == 0, shapes[-1]
        return real(mat1, mat2, *args, **kwargs)

    model = nn.Sequential(nn.Linear(32, 48, bias=False))
    reference = nn.Linear(32, 48, bias=False)
    reference.load_state_dict(model[0].state_dict())
    apply_fp8(model, recipe, module_filter=lambda module, fqn: True)
    assert type(model[0]).__name__ == "Float8Linear"
    monkeypatch.setattr(torch, "_scaled_mm", cuda_rule)
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(0))
    model(x).square().sum().backward()
    assert len(shapes) == 3 and shapes[2][0][1] % 16 == 0  # forward, input gradient, weight gradient (padded)
    reference(x).square().sum().backward()
    cosine = F.cosine_similarity(model[0].weight.grad.flatten(), reference.weight.grad.flatten(), dim=0)
    assert cosine > 0.99  # FP8's quantisation error, not a wrong contraction
