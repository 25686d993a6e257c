"""Tiny HF models of every built-in key family, the files ``save_pretrained`` writes for them (the oracle), and a
LightningModule that loads such a folder with ``from_pretrained`` in ``configure_model``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule

FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "deepseek_v3")

DEEPSEEK_V3 = dict(
    hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2, first_k_dense_replace=1,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    n_group=2, topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
    vocab_size=128,
)  # fmt: skip


def tiny_model(model_type: str, seed: int, **overrides: Any) -> torch.nn.Module:
    """A tiny HF causal LM of ``model_type`` with weights (and DeepSeek's ``e_score_correction_bias``) drawn from
    ``seed``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_moe_overlap.demo_hf import build_hf_model

    torch.manual_seed(seed)
    if model_type == "deepseek_v3":
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**DEEPSEEK_V3, **overrides}))
    else:
        model = build_hf_model(model_type, **overrides)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros at init: make a load of it visible
                buffer.normal_()
    return model


def saved(model_type: str, path: Path, seed: int = 0, **kwargs: Any) -> torch.nn.Module:
    """``tiny_model(model_type, seed)`` written to ``path`` by ``save_pretrained(**kwargs)``; returns the model."""
    model = tiny_model(model_type, seed)
    model.save_pretrained(path, **kwargs)
    return model


def state_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ (keys, dtype or any bit)."""
    if a.keys() != b.keys():
        return sorted(a.keys() ^ b.keys())
    return [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]


class LoadsInConfigureModel(LightningModule):
    """Lightning's place for a large model: ``AutoModelForCausalLM.from_pretrained(folder, **options)`` in
    ``configure_model``, nothing declared for the strategy; HF's own loss, SGD at ``lr``."""

    def __init__(self, folder: str, lr: float = 0.5, **options: Any) -> None:
        super().__init__()
        self.folder, self.lr, self.options, self.model = folder, lr, options, None

    def configure_model(self) -> None:
        from transformers import AutoModelForCausalLM

        if self.model is None:
            self.model = AutoModelForCausalLM.from_pretrained(self.folder, **self.options)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)
