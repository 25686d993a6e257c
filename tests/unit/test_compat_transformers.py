"""The transformers private names behind lightning_moe_overlap/_compat/transformers.py still mean what they did."""

from __future__ import annotations

import pytest

from lightning_moe_overlap._compat import transformers as compat

transformers = pytest.importorskip("transformers")


def test_attn_implementation_follows_set_attn_implementation():
    config = transformers.AutoConfig.for_model(
        "qwen3_moe", hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=2, num_experts_per_tok=1, vocab_size=32,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    assert compat.attn_implementation(model.config) == "eager", transformers.__version__
    model.set_attn_implementation("sdpa")
    assert compat.attn_implementation(model.config) == "sdpa", transformers.__version__


def test_from_config_builds_the_class_asked_for_in_its_dtype_with_float32_rotary_buffers():
    import torch

    config = transformers.AutoConfig.for_model(
        "qwen3_moe", hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=2, num_experts_per_tok=1, vocab_size=32,
    )
    with torch.device("meta"):
        model = compat.from_config(transformers.Qwen3MoeModel, config, dtype=torch.bfloat16)
    assert type(model) is transformers.Qwen3MoeModel, transformers.__version__
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and model.embed_tokens.weight.is_meta
    assert model.rotary_emb.inv_freq.dtype == torch.float32, transformers.__version__
