"""The demo models trained with plain SGD, for tests that compare parameters with a one-process run: with SGD the
parameters follow the gradients linearly, so "allclose" is a meaningful oracle."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule

from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.demo_hf import HFMoECausalLM
from lightning_moe_overlap.hf.context import context_parallel_loss

LR = 0.5


class SGDGPT(MoEGPT):
    """``MoEGPT`` with SGD at :data:`LR` instead of AdamW."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


class SGDQwen3(HFMoECausalLM):
    """HF transformers' Qwen3-MoE, tiny, 4 layers, trained with SGD at :data:`LR`; ``_loss`` is HF's own loss."""

    def __init__(self) -> None:
        super().__init__(model_type="qwen3_moe", config_overrides={"num_hidden_layers": 4})

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)

    def _loss(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens_BS, labels=tokens_BS).loss


def deepseek_model(*, vocab: int = 32, experts: int = 4, layers: int = 4) -> torch.nn.Module:
    """HF transformers' DeepSeek-V3, tiny (MLA attention, one shared expert, the router's correction bias), every
    layer MoE, its routers drawn away from HF's zero init so that routing is uneven."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=2, n_routed_experts=experts, num_experts_per_tok=2, n_group=1, topk_group=1,
        n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=4, vocab_size=vocab, routed_scaling_factor=1.0,
    )  # fmt: skip
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:  # routers away from zero (HF zero-initialises them): uneven routing
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    return model


class SGDDeepSeek(LightningModule):
    """HF DeepSeek-V3 (:func:`deepseek_model`) in a plain LightningModule: HF's own next-token loss, SGD at
    :data:`LR`; the built-in splitter cuts it at ``pp > 1``."""

    context_parallel = None  # at cp > 1 the strategy's handle: the loss is this cp rank's share (hf/context.py)

    def __init__(self, **sizes: int) -> None:
        super().__init__()
        self.model = deepseek_model(**sizes)

    def loss(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        if self.context_parallel is not None:
            kwargs = {"input_ids": tokens_BS, "labels": tokens_BS}
            return context_parallel_loss(self.model, self.context_parallel, kwargs)
        return self.model(input_ids=tokens_BS, labels=tokens_BS).loss

    _loss = loss

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)
