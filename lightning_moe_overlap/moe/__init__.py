"""Mixture-of-Experts layers, expert sharding and token dispatchers.

The expert-parallel seam is the *experts module*: anything with 3-D per-expert weights and
``forward(hidden_states_TD, top_k_index_TK, top_k_weights_TK) -> out_TD`` (this package's :class:`Experts`
and the Hugging Face v5 experts modules). :func:`apply_expert_parallel` swaps each one for an
:class:`ExpertParallelExperts` that holds this rank's experts and moves tokens with a dispatcher.
"""

from lightning_moe_overlap.moe.adapters import (
    ExpertsAdapter,
    FoundExperts,
    adapter_for,
    find_experts,
    find_moe_blocks,
    layout_of,
    register_experts_adapter,
    registered_adapters,
    unregister_experts_adapter,
)
from lightning_moe_overlap.moe.capacity import DROP_POLICIES, drop_over_capacity, expert_capacity
from lightning_moe_overlap.moe.dispatch import (
    AllGatherDispatcher,
    AllToAllDispatcher,
    DeepEPBuffers,
    FlexDispatcher,
    TokenDispatcher,
    build_dispatcher,
    require_flex_backend,
)
from lightning_moe_overlap.moe.ep import ExpertParallelExperts, ExpertShard, apply_expert_parallel
from lightning_moe_overlap.moe.experts import Experts
from lightning_moe_overlap.moe.grouped import GroupedLinear, RowSplits, grouped_linear, grouped_mlp
from lightning_moe_overlap.moe.layer import GatedMLP, MoELayer
from lightning_moe_overlap.moe.experts_layout import ExpertsLayout
from lightning_moe_overlap.moe.router import TopKRouter

__all__ = [
    "DROP_POLICIES",
    "AllGatherDispatcher",
    "AllToAllDispatcher",
    "DeepEPBuffers",
    "ExpertParallelExperts",
    "ExpertShard",
    "Experts",
    "ExpertsAdapter",
    "ExpertsLayout",
    "FlexDispatcher",
    "FoundExperts",
    "GatedMLP",
    "GroupedLinear",
    "MoELayer",
    "RowSplits",
    "TokenDispatcher",
    "TopKRouter",
    "adapter_for",
    "apply_expert_parallel",
    "build_dispatcher",
    "drop_over_capacity",
    "expert_capacity",
    "find_experts",
    "find_moe_blocks",
    "grouped_linear",
    "grouped_mlp",
    "layout_of",
    "register_experts_adapter",
    "registered_adapters",
    "require_flex_backend",
    "unregister_experts_adapter",
]
