"""The demo models trained with plain SGD, for tests that compare parameters with a one-process run: with SGD the
parameters follow the gradients linearly, so "allclose" is a meaningful oracle."""

from __future__ import annotations

import torch

from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.demo_hf import HFMoECausalLM

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
