"""The reference MoE layer: router + routed experts + optional shared experts, with an HF block's call signature.

``MoELayer.forward(hidden_states_BSD) -> out_BSD``, built like a Hugging Face v5 sparse MoE block: ``gate`` is
the router (returns ``(logits, weights_TK, indices_TK)``), ``experts`` the routed experts module (replaced by
:class:`~lightning_moe_overlap.moe.ep.ExpertParallelExperts` under expert parallelism), and ``shared_experts``
an optional gated MLP every token goes through.

Capacity (``capacity_factor``) is applied here on the rank's own tokens, before the experts; under expert
parallelism it stays the layer's one drop (``apply_expert_parallel`` gives the experts none).

``shared_expert_overlap``: the shared-expert forward is submitted to the comm runtime, so it runs at the routed
experts' token dispatch (while the tokens' all-to-all or all-gather is in flight; the count exchange before it
leaves it queued), in the context that called the layer, and its result is taken after the routed experts.
Without expert parallelism (no comm point) it simply runs when the result is taken.

Shape legend:
    B: batch   S: sequence   T: tokens (B * S)   D: hidden size   F: ffn size   K: top-k   E: experts
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from lightning_moe_overlap.moe.capacity import DropPolicy, drop_over_capacity, validate_capacity
from lightning_moe_overlap.moe.experts import Experts, ExpertsImpl, make_activation
from lightning_moe_overlap.moe.grouped import gated_activation
from lightning_moe_overlap.moe.router import TopKRouter
from lightning_moe_overlap.overlap.runtime import CommRuntime


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with a fused gate/up projection (the shared experts)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, activation: str | nn.Module = "silu") -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(ffn_hidden_size, hidden_size, bias=False)
        self.act_fn = make_activation(activation)

    def forward(self, x_TD: Tensor) -> Tensor:
        return self.down_proj(gated_activation(self.gate_up_proj(x_TD), self.act_fn))


class MoELayer(nn.Module):
    """A Mixture-of-Experts feed-forward layer.

    Args:
        hidden_size: ``D``.
        ffn_hidden_size: per routed expert ``F``.
        num_experts: routed experts ``E``.
        top_k: experts per token ``K``.
        shared_expert_ffn_hidden_size: ffn size of the shared experts (all of them fused into one MLP); ``None``
            for none.
        capacity_factor: per-expert capacity ``ceil(T*K/E * factor)`` on local tokens; ``None`` is dropless.
        token_drop_policy: ``"probs"`` (keep the highest-weight assignments per expert) or ``"position"``
            (keep the first ones).
        shared_expert_overlap: run the shared experts at the token dispatch (the first comm point that moves tokens).
        activation: activation of routed and shared experts.
        experts_impl: ``"grouped"`` or ``"loop"`` (see :class:`Experts`).
        runtime: the comm runtime; set by ``apply_expert_parallel``, needed only for ``shared_expert_overlap``.
        **router_kwargs: forwarded to :class:`TopKRouter` (``score_function``, ``num_groups``, ``group_topk``,
            ``enable_expert_bias``, ``aux_loss_coeff``, ``z_loss_coeff``, ...).
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        shared_expert_ffn_hidden_size: int | None = None,
        capacity_factor: float | None = None,
        token_drop_policy: DropPolicy = "probs",
        shared_expert_overlap: bool = False,
        activation: str = "silu",
        experts_impl: ExpertsImpl = "grouped",
        runtime: CommRuntime | None = None,
        **router_kwargs: Any,
    ) -> None:
        super().__init__()
        validate_capacity(capacity_factor, token_drop_policy, owner="`MoELayer`")
        if shared_expert_overlap and shared_expert_ffn_hidden_size is None:
            raise ValueError(
                "`MoELayer`: shared_expert_overlap=True but shared_expert_ffn_hidden_size=None, so there is no "
                "shared expert to overlap. Set shared_expert_ffn_hidden_size, or shared_expert_overlap=False."
            )
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.token_drop_policy: DropPolicy = token_drop_policy
        self.shared_expert_overlap = shared_expert_overlap
        self.runtime = runtime
        self.gate = TopKRouter(hidden_size, num_experts, top_k, **router_kwargs)
        self.experts: nn.Module = Experts(
            num_experts, hidden_size, ffn_hidden_size, activation=activation, impl=experts_impl
        )
        self.shared_experts = (
            GatedMLP(hidden_size, shared_expert_ffn_hidden_size, activation)
            if shared_expert_ffn_hidden_size is not None
            else None
        )

    def forward(self, hidden_states: Tensor) -> Tensor:
        """``[..., D] -> [..., D]``."""
        shape = hidden_states.shape
        x_TD = hidden_states.reshape(-1, self.hidden_size)
        shared = self.shared_experts
        side = None
        if shared is not None and self.shared_expert_overlap and self.runtime is not None:
            side = self.runtime.submit(lambda: shared(x_TD))
        _, weights_TK, indices_TK = self.gate(x_TD)
        if self.capacity_factor is not None:
            indices_TK, weights_TK = drop_over_capacity(
                indices_TK, weights_TK, self.num_experts, self.capacity_factor, self.token_drop_policy
            )
        out_TD = self.experts(x_TD, indices_TK, weights_TK)
        if shared is not None:
            out_TD = out_TD + (side.result() if side is not None else shared(x_TD))
        return out_TD.view(shape)

    def extra_repr(self) -> str:
        return (
            f"capacity_factor={self.capacity_factor}, token_drop_policy={self.token_drop_policy!r}, "
            f"shared_expert_overlap={self.shared_expert_overlap}"
        )
