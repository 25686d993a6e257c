"""HF DeepSeek-V3's ``e_score_correction_bias`` is updated after each step (aux-loss-free balancing)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_moe_overlap.config import OverlapConfig
from lightning_moe_overlap.moe.bias import CorrectionBiasBalancer, correction_bias_balancers
from lightning_moe_overlap.moe.model_handle import MoEModelHandle

E = 8


def deepseek_block() -> nn.Module:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = DeepseekV3Config(hidden_size=16, moe_intermediate_size=8, n_routed_experts=E, num_experts_per_tok=2,
                              n_group=2, topk_group=2, n_shared_experts=1, routed_scaling_factor=1.0)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    block = DeepseekV3MoE(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.2)
        block.gate.weight[0].add_(1.0)  # a router that prefers expert 0 for inputs along +1
        block.gate.e_score_correction_bias.zero_()
    return block


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = deepseek_block()


def imbalance(block: nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        _, _, indices = block.gate(x)
    counts = torch.bincount(indices.reshape(-1), minlength=E).double()
    return float(counts.max() / counts.mean())


def test_bias_moves_toward_balance_over_steps() -> None:
    model = Holder()
    moe = MoEModelHandle(model)
    moe.apply(OverlapConfig(), SimpleNamespace(ep=None), runtime=None)  # the strategy's path, one process
    block = model.mlp
    x = torch.randn(64, 16) + 0.5
    before = imbalance(block, x)
    rate = 0.01
    moe._bias_balancers[0].update_rate = rate
    for _ in range(40):
        block.train()
        block(x.view(4, 16, 16)).sum().backward()
        moe.update_expert_bias(group=None)
    after = imbalance(block, x)
    bias = block.gate.e_score_correction_bias
    assert before > 1.5
    assert after < before
    assert float(bias[0]) < 0  # the over-loaded expert is pushed down
    steps = bias / rate
    assert torch.allclose(steps, steps.round(), atol=1e-3)  # moved in steps of exactly `rate`


def test_counts_only_training_forwards_and_reset() -> None:
    block = deepseek_block()
    (balancer,) = correction_bias_balancers(nn.Sequential(block))
    x = torch.randn(2, 8, 16)
    block.eval()
    block(x)
    assert balancer.counts_E is None
    block.train()
    block(x)
    assert int(balancer.counts_E.sum()) == 16 * 2
    balancer.update()
    assert balancer.counts_E is None


def test_router_with_bias_but_no_experts_is_refused() -> None:
    class Router(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.e_score_correction_bias = nn.Buffer(torch.zeros(4))

    block = nn.Module()
    block.gate = Router()
    with pytest.raises(NotImplementedError, match="has no `experts` module.*cannot be updated"):
        correction_bias_balancers(nn.Sequential(block))


def test_balancer_steps_like_topk_router() -> None:
    router = nn.Module()
    router.e_score_correction_bias = nn.Buffer(torch.zeros(4))
    experts = nn.Linear(1, 1)
    experts.forward = lambda h, idx, w: h  # type: ignore[method-assign]
    balancer = CorrectionBiasBalancer(router, experts, update_rate=0.5)
    experts(torch.zeros(3, 1), torch.tensor([[0, 1], [0, 2], [0, 1]]), torch.ones(3, 2))
    balancer.update()
    # counts [3, 2, 1, 0], mean 1.5: +-0.5 by the sign of mean - count
    assert router.e_score_correction_bias.tolist() == [-0.5, -0.5, 0.5, 0.5]
