"""Aux-loss-free balancing for routers that are not this package's: HF ``e_score_correction_bias``.

DeepSeek-V3 style routers of Hugging Face transformers (DeepSeek-V3, Dots1, Kimi-Linear, ...) hold an
``e_score_correction_bias`` buffer added to the scores before the top-k, but transformers never updates it in
training (the original update lives in DeepSeek's training code). :class:`CorrectionBiasBalancer` updates it
with the rule of :meth:`~lightning_moe_overlap.moe.router.TopKRouter.update_expert_bias` (megatron-core's):
count the tokens routed to each expert during the step's training forwards (on the device, at the block's
experts input), sum the counts over the ranks that see distinct tokens, and move the bias by
``update_rate * sign(mean - count)``.

Shape legend: T tokens, K top-k, E experts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_moe_overlap.moe.router import TopKRouter, _in_training_forward

BIAS_NAME = "e_score_correction_bias"
DEFAULT_UPDATE_RATE = 1e-3  # megatron-core's moe_router_bias_update_rate, TopKRouter's default


class CorrectionBiasBalancer:
    """Counts the tokens of one MoE block and updates its router's ``e_score_correction_bias`` after each step.

    Args:
        router: the module holding the bias.
        experts: the block's experts module; its forward receives ``(hidden_TD, indices_TK, weights_TK)``.
        update_rate: the bias step per update.
    """

    def __init__(self, router: nn.Module, experts: nn.Module, update_rate: float = DEFAULT_UPDATE_RATE) -> None:
        bias = getattr(router, BIAS_NAME)
        self.router = router
        self.update_rate = update_rate
        self.num_experts = int(bias.numel())
        self.counts_E: Tensor | None = None
        self._handle = experts.register_forward_pre_hook(self._count)

    def _count(self, module: nn.Module, args: Any) -> None:
        if not (module.training and _in_training_forward()) or len(args) < 2:
            return
        with torch.no_grad():
            flat = args[1].reshape(-1).long()
            valid = (flat >= 0) & (flat < self.num_experts)
            counts = torch.zeros(self.num_experts + 1, dtype=torch.int64, device=flat.device)
            counts.index_add_(0, torch.where(valid, flat, self.num_experts), torch.ones_like(flat))
            counts = counts[: self.num_experts]
            self.counts_E = counts if self.counts_E is None else self.counts_E + counts

    @torch.no_grad()
    def update(self, group: dist.ProcessGroup | None = None) -> None:
        """Move the bias towards balance from the counts since the last call, then reset them (collective over
        ``group`` when it has more than one rank: every rank must call it after the same step)."""
        bias: Tensor = getattr(self.router, BIAS_NAME)
        counts = (
            self.counts_E.to(torch.float64)
            if self.counts_E is not None
            else torch.zeros(self.num_experts, dtype=torch.float64, device=bias.device)
        )
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
        offset = counts.mean() - counts
        bias += (torch.sign(offset) * self.update_rate).to(bias.device, bias.dtype)
        self.counts_E = None

    def remove(self) -> None:
        self._handle.remove()


def correction_bias_balancers(
    model: nn.Module, update_rate: float = DEFAULT_UPDATE_RATE
) -> list[CorrectionBiasBalancer]:
    """A balancer for every router of ``model`` with an ``e_score_correction_bias`` tensor (not ``TopKRouter``,
    which updates its own ``expert_bias``).

    Raises:
        NotImplementedError: such a router's parent block has no ``experts`` module to count tokens at.
    """
    balancers = []
    for name, block in model.named_modules():
        for attr, router in block.named_children():
            if isinstance(router, TopKRouter) or not isinstance(getattr(router, BIAS_NAME, None), Tensor):
                continue
            experts = getattr(block, "experts", None)
            if not isinstance(experts, nn.Module):
                raise NotImplementedError(
                    f"`{name}.{attr}` ({type(router).__name__}) has an `{BIAS_NAME}` for aux-loss-free balancing, but "
                    f"its block `{name}` has no `experts` module whose input gives the routed experts, so the bias "
                    "cannot be updated and the routing would never balance. Give the block an `experts` module with "
                    "forward(hidden_states, top_k_index, top_k_weights), or remove the bias to freeze it deliberately."
                )
            balancers.append(CorrectionBiasBalancer(router, experts, update_rate))
    return balancers
