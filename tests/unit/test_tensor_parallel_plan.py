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
