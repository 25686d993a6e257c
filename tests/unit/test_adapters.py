"""Adapters: finding experts modules in tiny HF v5 models, swapping them (ep=1), the registration hook, errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from lightning_moe_overlap.moe import (
    ExpertParallelExperts,
    Experts,
    ExpertShard,
    ExpertsLayout,
    MoELayer,
    apply_expert_parallel,
    find_experts,
    find_moe_blocks,
    layout_of,
    register_experts_adapter,
    unregister_experts_adapter,
)
from lightning_moe_overlap.overlap.runtime import CommRuntime

COMMON = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
}


def _hf(name: str) -> nn.Module:
    import transformers as tf

    configs = {
        "qwen3_moe": (
            tf.Qwen3MoeForCausalLM,
            tf.Qwen3MoeConfig(
                intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, **COMMON
            ),
        ),
        "mixtral": (
            tf.MixtralForCausalLM,
            tf.MixtralConfig(intermediate_size=16, num_local_experts=8, num_experts_per_tok=2, **COMMON),
        ),
        "olmoe": (
            tf.OlmoeForCausalLM,
            tf.OlmoeConfig(
                intermediate_size=16, num_experts=8, num_experts_per_tok=2, pad_token_id=0, eos_token_id=1, **COMMON
            ),
        ),
        "qwen2_moe": (
            tf.Qwen2MoeForCausalLM,
            tf.Qwen2MoeConfig(
                intermediate_size=64,
                moe_intermediate_size=16,
                shared_expert_intermediate_size=32,
                num_experts=8,
                num_experts_per_tok=2,
                **COMMON,
            ),
        ),
        "deepseek_v3": (
            tf.DeepseekV3ForCausalLM,
            tf.DeepseekV3Config(
                intermediate_size=64,
                moe_intermediate_size=16,
                n_routed_experts=8,
                num_experts_per_tok=2,
                n_group=2,
                topk_group=1,
                n_shared_experts=1,
                first_k_dense_replace=1,
                kv_lora_rank=16,
                q_lora_rank=16,
                qk_rope_head_dim=8,
                qk_nope_head_dim=8,
                v_head_dim=8,
                **{**COMMON, "num_key_value_heads": 4},
            ),
        ),
        "gpt_oss": (
            tf.GptOssForCausalLM,
            tf.GptOssConfig(intermediate_size=16, num_local_experts=8, num_experts_per_tok=2, head_dim=8, **COMMON),
        ),
    }
    cls, config = configs[name]
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = cls(config).double()
    with torch.no_grad():
        for p in model.parameters():
            if p.abs().sum() == 0:  # zero-initialised routers and biases: make routing non-trivial
                p.normal_(0.0, 0.2)
    return model


EXPECTED = {
    "qwen3_moe": ("Qwen3MoeExperts", ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]),
    "mixtral": ("MixtralExperts", ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]),
    "olmoe": ("OlmoeExperts", ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]),
    "qwen2_moe": ("Qwen2MoeExperts", ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]),
    "deepseek_v3": ("DeepseekV3Experts", ["model.layers.1.mlp.experts"]),  # layer 0 is dense
    "gpt_oss": ("GptOssExperts", ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_hf_models_found_swapped_and_equal(name: str) -> None:
    model = _hf(name)
    cls_name, names = EXPECTED[name]
    found = find_experts(model)
    assert list(found) == names
    assert all(type(f.module).__name__ == cls_name and f.adapter.name == "transformers_v5" for f in found.values())
    assert find_moe_blocks(model) == dict.fromkeys(names, 8)
    ep_model = copy.deepcopy(model)
    wrapped = apply_expert_parallel(ep_model, None, runtime=CommRuntime())
    assert [type(m) for m in wrapped] == [ExpertParallelExperts] * len(names)
    # Only the experts changed: routers, shared experts and attention are the same modules.
    before = {n: type(m).__name__ for n, m in model.named_modules() if ".experts" not in n}
    after = {n: type(m).__name__ for n, m in ep_model.named_modules() if ".experts" not in n}
    assert before == after
    # Same parameter names and shapes (ep=1 keeps every expert).
    assert [(n, p.shape) for n, p in model.named_parameters()] == [(n, p.shape) for n, p in ep_model.named_parameters()]
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    ref, out = model(ids).logits, ep_model(ids).logits
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    ref.square().mean().backward()
    out.square().mean().backward()
    for (pname, a), (_, b) in zip(model.named_parameters(), ep_model.named_parameters()):
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, atol=1e-10, rtol=1e-10, msg=pname)


@pytest.mark.parametrize("training", [False, True])
def test_the_expert_parallel_module_keeps_the_mode_of_the_one_it_replaces(training: bool) -> None:
    model = _hf("qwen3_moe").train(training)  # `from_pretrained` returns a model in eval mode
    apply_expert_parallel(model, None, runtime=CommRuntime())
    assert {m.training for m in model.modules()} == {training}


def test_gpt_oss_layout_is_transposed_with_bias_and_its_own_gate() -> None:
    experts = _hf("gpt_oss").model.layers[0].mlp.experts
    layout = layout_of(experts)
    assert layout.transposed and layout.gated and layout.gate_fn is not None
    assert layout.parameter_names == ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
    # The gate is bound to a weight-free copy: it keeps alpha/limit, not the full expert tensors.
    shell = layout.gate_fn.__self__
    assert not list(shell.parameters()) and shell.limit == experts.limit


def test_ungated_experts_nemotron_h() -> None:
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

    config = NemotronHConfig(hidden_size=16, moe_intermediate_size=8, n_routed_experts=4, num_experts_per_tok=2)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    hf = NemotronHExperts(config).double()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    layout = layout_of(hf)
    assert layout.up_name == "up_proj" and not layout.gated
    holder = nn.ModuleDict({"experts": copy.deepcopy(hf)})
    (ep,) = apply_expert_parallel(holder, None, runtime=CommRuntime())
    x = torch.randn(7, 16, dtype=torch.float64)
    idx = torch.stack([torch.randperm(4)[:2] for _ in range(7)])
    w = torch.rand(7, 2, dtype=torch.float64)
    torch.testing.assert_close(ep(x, idx, w), hf(x, idx, w))


def test_modules_without_the_experts_interface_are_not_matched() -> None:
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

    llama4 = Llama4TextExperts(Llama4TextConfig(hidden_size=16, intermediate_size=8, num_local_experts=4))
    assert find_experts(nn.ModuleDict({"e": llama4, "mlp": nn.Linear(4, 4)})) == {}  # forward takes pre-sorted rows


def test_own_layer_found_and_runtime_given_to_the_layer() -> None:
    model = nn.Sequential(MoELayer(8, 4, 4, 2), MoELayer(8, 4, 4, 1))
    assert find_moe_blocks(model) == {"0.experts": 4, "1.experts": 4}
    assert all(f.adapter.name == "lightning_moe_overlap" for f in find_experts(model).values())
    runtime = CommRuntime()
    apply_expert_parallel(model, None, runtime=runtime)
    assert model[0].runtime is runtime and isinstance(model[1].experts, ExpertParallelExperts)
    assert find_moe_blocks(model) == {}  # already expert-parallel: nothing left to wrap


class TwoMatrixExperts(nn.Module):
    """A user's experts module with its own names, ``[E, in, out]`` weights and ReLU^2."""

    def __init__(self) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(4, 8, 6, dtype=torch.float64))
        self.w_out = nn.Parameter(torch.randn(4, 6, 8, dtype=torch.float64))

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        out = torch.zeros_like(hidden_states)
        for e in range(4):
            t, k = torch.where(top_k_index == e)
            y = torch.relu(hidden_states[t] @ self.w_in[e]).square() @ self.w_out[e]
            out = out.index_add(0, t, y * top_k_weights[t, k, None])
        return out


def test_register_experts_adapter_for_a_custom_block() -> None:
    adapter = register_experts_adapter(
        "two_matrix",
        matches=lambda m: isinstance(m, TwoMatrixExperts),
        layout=lambda m: ExpertsLayout(
            act_fn=lambda h: torch.relu(h).square(), up_name="w_in", down_name="w_out", transposed=True, gated=False
        ),
    )
    try:
        model = nn.ModuleDict({"block": nn.ModuleDict({"experts": TwoMatrixExperts()})})
        assert find_experts(model)["block.experts"].adapter is adapter
        ref = copy.deepcopy(model)
        (ep,) = apply_expert_parallel(model, None, runtime=CommRuntime())
        assert [n for n, _ in ep.named_parameters()] == ["w_in", "w_out"]
        x = torch.randn(5, 8, dtype=torch.float64)
        idx = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 3], [0, 2]])
        w = torch.rand(5, 2, dtype=torch.float64)
        torch.testing.assert_close(ep(x, idx, w), ref["block"]["experts"](x, idx, w))
        with pytest.raises(ValueError, match="an adapter named 'two_matrix' is already registered"):
            register_experts_adapter("two_matrix", lambda m: False, lambda m: None)
    finally:
        unregister_experts_adapter("two_matrix")
    assert find_experts(nn.ModuleDict({"experts": TwoMatrixExperts()})) == {}


def test_registry_errors() -> None:
    with pytest.raises(TypeError, match="must both be callables taking the module"):
        register_experts_adapter("broken", matches=True, layout=lambda m: None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no user adapter named 'nope'"):
        unregister_experts_adapter("nope")
    with pytest.raises(TypeError, match="no adapter recognises Linear"):
        layout_of(nn.Linear(2, 2))


class PostNormExperts(Experts):
    has_post_expert_norm = True


class ScaledExperts(Experts):
    def __init__(self) -> None:
        super().__init__(4, 8, 4)
        self.scale = nn.Parameter(torch.ones(4))


def test_unshardable_variants_raise_before_changing_anything() -> None:
    from lightning_moe_overlap.moe.adapters import HF_V5_ADAPTER

    post = PostNormExperts(4, 8, 4)
    with pytest.raises(NotImplementedError, match="applies a norm after each expert"):
        HF_V5_ADAPTER.layout(post)
    model = nn.ModuleDict({"experts": ScaledExperts()})
    with pytest.raises(NotImplementedError, match=r"has parameters \['scale'\] that its layout does not describe"):
        apply_expert_parallel(model, None, runtime=CommRuntime())


def test_layout_naming_a_missing_tensor() -> None:
    from lightning_moe_overlap.moe.dispatch import AllToAllDispatcher

    bad = ExpertsLayout(act_fn=torch.relu, up_name="gate_up_proj", down_bias_name="down_bias")
    with pytest.raises(ValueError, match=r"the layout names \['down_bias'\], which Experts does not have"):
        ExpertParallelExperts(Experts(4, 8, 4), bad, AllToAllDispatcher(None, 4, None))
    with pytest.raises(ValueError, match="has 4 experts but the dispatcher was built for num_experts=8"):
        ExpertParallelExperts(Experts(4, 8, 4), ExpertsLayout(act_fn=torch.relu), AllToAllDispatcher(None, 8, None))


class BiasedExperts(Experts):
    def __init__(self) -> None:
        super().__init__(4, 8, 4)
        self.down_bias = nn.Parameter(torch.zeros(3, 8))  # wrong leading dimension


def test_per_expert_tensors_must_lead_with_the_expert_dimension() -> None:
    from lightning_moe_overlap.moe.dispatch import AllToAllDispatcher

    layout = ExpertsLayout(act_fn=torch.relu, down_bias_name="down_bias")
    with pytest.raises(ValueError, match=r"`down_bias` has 3 rows in dim 0 but `gate_up_proj` has 4"):
        ExpertParallelExperts(BiasedExperts(), layout, AllToAllDispatcher(None, 4, None))


def test_apply_expert_parallel_argument_errors() -> None:
    model = nn.ModuleDict({"experts": Experts(4, 8, 4)})
    with pytest.raises(TypeError, match="got int for the groups; expected a `ParallelGroups`"):
        apply_expert_parallel(model, 2, runtime=CommRuntime())
    with pytest.raises(ValueError, match=r"token_drop_policy='first'"):
        apply_expert_parallel(model, None, runtime=CommRuntime(), token_drop_policy="first")  # type: ignore[arg-type]
    assert isinstance(model["experts"], Experts)  # nothing was swapped


def test_expert_shard_maps_local_to_global() -> None:
    shard = ExpertShard(num_experts=8, first_expert=4, num_local=2)
    assert shard.global_index(1) == 5 and list(shard.global_range) == [4, 5]
    with pytest.raises(
        ValueError, match=r"local_index=2 is outside \[0, 2\); this shard holds global experts \[4, 6\)"
    ):
        shard.global_index(2)
