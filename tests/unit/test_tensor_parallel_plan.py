"""The tensor-parallel plans, built without a process group: what they shard, what they leave out, and every error."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.demo_hf import HFMoECausalLM, build_hf_model
from lightning_moe_overlap.parallelize.tensor_plan import TensorParallelPlanError, hf_tensor_parallel_plan, plan_of


def _mesh(size: int) -> SimpleNamespace:
    return SimpleNamespace(size=lambda: size, get_local_rank=lambda: 0)


def test_the_hf_plan_shards_attention_and_leaves_the_moe_blocks_out():
    module = HFMoECausalLM(model_type="qwen3_moe")
    plan = plan_of(module, _mesh(2))  # found through the LightningModule: the HF model sits at `model`
    layers = module.model.config.num_hidden_layers
    for layer in range(layers):
        root = f"model.model.layers.{layer}"
        assert all(isinstance(plan[f"{root}.self_attn.{p}_proj"], ColwiseParallel) for p in "qkv")
        o_proj = plan[f"{root}.self_attn.o_proj"]
        assert isinstance(o_proj, RowwiseParallel) and o_proj.output_layouts == (Shard(1),)
        assert isinstance(plan[f"{root}.self_attn"], PrepareModuleInput)  # gathers the sequence-parallel input
    assert not [name for name in plan if ".mlp" in name]  # experts, router: not tensor-parallel (ETP = 1)
    first = plan["model.model.layers.0"]
    assert isinstance(first, PrepareModuleInput) and first.desired_input_layouts == (Shard(1),)
    head = plan["model.lm_head"]
    # vocabulary-parallel logits (loss_parallel), not gathered
    assert isinstance(head, ColwiseParallel) and head.output_layouts == (Shard(-1),) and not head.use_local_output
    assert isinstance(plan["model.model.embed_tokens"], RowwiseParallel)


def test_the_hf_plan_refuses_a_tp_that_does_not_divide_the_heads():
    model = build_hf_model("qwen3_moe")
    heads = model.config.num_attention_heads
    with pytest.raises(TensorParallelPlanError, match=rf"num_attention_heads={heads}.*tp={heads + 1} does not divide"):
        hf_tensor_parallel_plan(model, heads + 1)


def test_the_hf_plan_refuses_tied_embeddings():
    model = build_hf_model("qwen3_moe", tie_word_embeddings=True)
    with pytest.raises(TensorParallelPlanError, match=r"tie_word_embeddings=True.*Fix: tp=1 for this model"):
        hf_tensor_parallel_plan(model, 2)


def test_the_hf_plan_refuses_a_style_it_does_not_map(monkeypatch):
    model = build_hf_model("qwen3_moe")
    monkeypatch.setattr(model.config, "base_model_tp_plan", {"layers.*.self_attn.q_proj": "colwise_rep"})
    with pytest.raises(TensorParallelPlanError, match=r"plans `layers.0.self_attn.q_proj` as 'colwise_rep'"):
        hf_tensor_parallel_plan(model, 2)


def test_a_module_without_a_plan_is_refused_naming_the_hook():
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 4)

    with pytest.raises(TensorParallelPlanError, match=r"`Plain` has no tensor-parallel plan.*`tensor_parallel_plan`"):
        plan_of(Plain(), _mesh(2))


def test_moegpt_plan_and_its_head_rule():
    model = MoEGPT(num_heads=4, hidden_size=32)
    plan = plan_of(model, _mesh(2))
    assert set(plan) == {"embed", "layers.*.attn", "layers.*.attn.proj", "head"}
    assert all(layer.attn.tp_mesh is not None for layer in model.layers)
    with pytest.raises(ValueError, match=r"num_heads=4, hidden_size=32 with tp=3: each tp rank computes heads / tp"):
        MoEGPT(num_heads=4, hidden_size=32).tensor_parallel_plan(_mesh(3))


def test_moegpt_attention_is_unchanged_without_a_tp_mesh():
    attn = MoEGPT(num_heads=4, hidden_size=32).layers[0].attn
    x = torch.randn(2, 5, 32)
    q, k, v = attn.qkv(x).view(2, 5, 3, 4, 8).unbind(2)
    expected = attn.proj(
        torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         is_causal=True).transpose(1, 2).reshape(2, 5, 32)
    )  # fmt: skip
    assert torch.equal(attn(x), expected)


def test_the_hf_plan_maps_latent_attention_down_projections_to_whole_gradient_replicas():
    from lightning_moe_overlap.parallel.tp_styles import WholeGradientReplica
    from tests.helpers.sgd import deepseek_model

    model = deepseek_model()  # DeepSeek-V3: q_lora_rank and kv_lora_rank set, qk_rope_head_dim=4
    plan = hf_tensor_parallel_plan(model, 2)
    attn = "model.layers.1.self_attn"
    kv_a = plan[f"{attn}.kv_a_proj_with_mqa"]  # HF's 'mla_kv_a_proj'
    assert isinstance(kv_a, WholeGradientReplica) and kv_a.rope_dim == model.config.qk_rope_head_dim
    for sibling in ("q_a_proj", "q_a_layernorm", "kv_a_layernorm"):  # before the column-wise up-projections
        style = plan[f"{attn}.{sibling}"]
        assert isinstance(style, WholeGradientReplica) and style.rope_dim is None, sibling
    assert all(isinstance(plan[f"{attn}.{p}"], ColwiseParallel) for p in ("q_b_proj", "kv_b_proj"))
    assert isinstance(plan[attn], PrepareModuleInput)


def test_the_hf_plan_refuses_latent_attention_without_a_rope_width():
    from lightning_moe_overlap.parallelize.tensor_plan import _hf_style

    config = SimpleNamespace(qk_rope_head_dim=None)  # a custom config planning MLA without saying the rope width
    with pytest.raises(TensorParallelPlanError, match=r"'mla_kv_a_proj'.*qk_rope_head_dim=None.*Fix: set"):
        _hf_style("mla_kv_a_proj", "layers.0.self_attn.kv_a_proj_with_mqa", "MyMLA", config)


def test_a_whole_gradient_replica_sums_only_the_rope_columns_gradient_and_is_left_out_of_the_tp_sum(tmp_path):
    """On a 1-rank gloo group: the style's hook keeps the forward, passes the rope columns' gradient through the
    group's sum (here: itself) and the rest untouched; ``TensorParallelGrads`` does not name its parameters."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_moe_overlap.parallel.tp_styles import WHOLE_GRADIENT_ATTR, WholeGradientReplica
    from lightning_moe_overlap.parallelize.tensor_plan import TensorParallelGrads

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
        WholeGradientReplica(rope_dim=2)._apply(model[0], mesh)
        assert getattr(model[0], WHOLE_GRADIENT_ATTR) is True
        x = torch.randn(5, 4)
        out = model[0](x)
        torch.testing.assert_close(out, x @ model[0].weight.T + model[0].bias, rtol=0, atol=0)
        weights = torch.randn(5, 6)
        (out * weights).sum().backward()
        torch.testing.assert_close(model[0].weight.grad, weights.T @ x)
        names = TensorParallelGrads.of(model, dist.group.WORLD).names
        assert names == ("1.weight", "1.bias"), names
    finally:
        if owned:
            dist.destroy_process_group()
