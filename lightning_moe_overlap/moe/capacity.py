"""Expert capacity and token dropping, applied per rank on its local tokens before dispatch.

``capacity = ceil(T * K / E * capacity_factor)`` (megatron-core's ``get_capacity`` on ``T * K`` assignments).
Each expert keeps at most ``capacity`` of the (token, choice) assignments routed to it:

- ``"probs"``: the ones with the highest routing weight (ties: earlier assignment first);
- ``"position"``: the first ones in token order.

A dropped assignment gets the index ``E`` (the Hugging Face convention for "skip") and weight zero, so it is
neither computed nor sent, and it contributes nothing to the output or to any gradient.

Shape legend:
    T: tokens on this rank    K: top-k    E: experts    A: flattened assignments (``T * K``)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_moe_overlap._checks import is_positive_number
from lightning_moe_overlap.config import DROP_POLICIES, DropPolicy
from lightning_moe_overlap.moe.permute import count_per_expert, expert_key


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """``ceil(num_tokens * top_k / num_experts * capacity_factor)``, as megatron-core's ``get_capacity``."""
    return math.ceil((num_tokens * top_k / num_experts) * capacity_factor)


def capacity_problems(capacity_factor: float | None, token_drop_policy: str) -> dict[str, str]:
    """The capacity rules, in one place: ``{setting: what is wrong, the rule and the fix}`` for each bad setting
    (empty when both are valid). :func:`validate_capacity` raises the first; the strategy's configuration check
    (``validation.rule_capacity``) reports each."""
    problems: dict[str, str] = {}
    if capacity_factor is not None and not is_positive_number(capacity_factor):
        problems["capacity_factor"] = (
            f"capacity_factor={capacity_factor!r} must be None (dropless) or a positive number; "
            "values around 1.0-2.0 are usual."
        )
    if token_drop_policy not in DROP_POLICIES:
        problems["token_drop_policy"] = (
            f"token_drop_policy={token_drop_policy!r} is not one of {list(DROP_POLICIES)}; "
            "'probs' keeps the highest-weight assignments per expert, 'position' the first ones."
        )
    return problems


def validate_capacity(capacity_factor: float | None, token_drop_policy: str, *, owner: str) -> None:
    """Raise ``ValueError`` for a non-positive factor or an unknown policy (the first found), naming ``owner``."""
    problems = capacity_problems(capacity_factor, token_drop_policy)
    if problems:
        raise ValueError(f"{owner}: {next(iter(problems.values()))}")


def drop_over_capacity(
    indices_TK: Tensor,
    weights_TK: Tensor,
    num_experts: int,
    capacity_factor: float,
    policy: DropPolicy = "probs",
) -> tuple[Tensor, Tensor]:
    """Drop the assignments beyond each expert's capacity.

    Args:
        indices_TK: expert of each (token, choice); entries outside ``[0, E)`` are already dropped and stay so.
        weights_TK: routing weight of each (token, choice).
        num_experts: ``E``.
        capacity_factor: the factor in ``capacity = ceil(T*K/E * factor)``.
        policy: ``"probs"`` or ``"position"`` (see the module docstring).

    Returns:
        ``(indices_TK, weights_TK)`` with the dropped assignments set to ``E`` and ``0`` (the weights keep their
        autograd graph: kept entries are the input weights, dropped entries are multiplied by zero).
    """
    validate_capacity(capacity_factor, policy, owner="`drop_over_capacity`")
    num_tokens, top_k = indices_TK.shape
    capacity = expert_capacity(num_tokens, top_k, num_experts, capacity_factor)
    expert = expert_key(indices_TK, num_experts)  # dropped already: E
    position = torch.arange(expert.numel(), device=expert.device)
    if policy == "probs":
        # Sort by (expert, -weight, position): stable sort on weight first, then on expert.
        by_weight = torch.argsort(-weights_TK.detach().reshape(-1).float(), stable=True)
        order = by_weight[torch.argsort(expert[by_weight], stable=True)]
    else:
        order = torch.argsort(expert, stable=True)
    sorted_expert = expert[order]
    counts = count_per_expert(sorted_expert, num_experts + 1)  # on the device: no host sync
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = position - starts[sorted_expert]  # 0, 1, 2, ... inside each expert's run
    keep_sorted = (rank_in_expert < capacity) & (sorted_expert < num_experts)
    keep = torch.empty_like(keep_sorted)
    keep[order] = keep_sorted
    keep_TK = keep.view(num_tokens, top_k)
    new_indices = torch.where(keep_TK, indices_TK, torch.full_like(indices_TK, num_experts))
    new_weights = weights_TK * keep_TK.to(weights_TK.dtype)
    return new_indices, new_weights
