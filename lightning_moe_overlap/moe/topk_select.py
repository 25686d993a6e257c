"""The router's top-k selection, kept in ``[T, K]``: megatron-core's ``topk_routing_with_score_function`` without its
dense ``[T, E]`` outputs.

megatron-core computes the ``K`` scores and indices of each token, then scatters them into a dense probability
table and a 0/1 routing map; a router that hands ``(weights_TK, indices_TK)`` on (the Hugging Face v5 contract)
gathered them back out. Those round trips cost 8 ATen ops per layer and micro-batch in the forward (two
``zeros_like``, two ``scatter``, three dtype copies, a second ``topk``) and one in the backward. Here the
same arithmetic runs on the ``[T, K]`` values only: the same ``topk`` of the same scores, the same softmax /
sigmoid / renormalisation / scaling in the same dtypes, and megatron-core's own ``group_limited_topk`` for the
group limit. The results are bitwise megatron-core's (``tests/unit/test_topk_select.py`` compares every score
function, the group limit, the expert bias and the scaling with its function); the indices come sorted ascending
per token, the order the dense map gave.

Shape legend:
    T: tokens    E: experts    K: top-k
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def select_topk(
    logits_TE: Tensor,
    top_k: int,
    *,
    mcore: Any,
    pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    score_function: str = "softmax",
    expert_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(weights_TK, indices_TK)``: each token's ``K`` experts in ascending order and their routing weights, as
    megatron-core's ``topk_routing_with_score_function(logits_TE, ...)`` would give them in its dense outputs.
    ``mcore``: megatron-core's ``moe_utils`` module (for ``group_limited_topk``)."""
    tokens, experts = logits_TE.shape

    def topk(scores_TE: Tensor) -> tuple[Tensor, Tensor]:
        if group_topk:
            return mcore.group_limited_topk(
                scores=scores_TE, topk=top_k, num_tokens=tokens, num_experts=experts, num_groups=num_groups,
                group_topk=group_topk,
            )  # fmt: skip
        return torch.topk(scores_TE, k=top_k, dim=1)

    if score_function == "softmax":
        if pre_softmax:
            probs_TK, indices_TK = topk(torch.softmax(logits_TE, dim=-1, dtype=torch.float32).type_as(logits_TE))
        else:
            scores_TK, indices_TK = topk(logits_TE)
            probs_TK = torch.softmax(scores_TK, dim=-1, dtype=torch.float32).type_as(logits_TE)
    elif score_function == "sigmoid":
        scores_TE = torch.sigmoid(logits_TE.float()).type_as(logits_TE)
        if expert_bias is not None:
            _, indices_TK = topk(scores_TE + expert_bias)
            scores_TK = torch.gather(scores_TE, dim=1, index=indices_TK).type_as(logits_TE)
        else:
            scores_TK, indices_TK = topk(scores_TE)
        probs_TK = scores_TK / (scores_TK.sum(dim=-1, keepdim=True) + 1e-20) if top_k > 1 else scores_TK
    else:
        raise ValueError(f"score_function={score_function!r}: expected 'softmax' or 'sigmoid'.")
    if scaling_factor:
        probs_TK = probs_TK * scaling_factor
    if top_k == 1:
        return probs_TK, indices_TK
    indices_TK, order_TK = indices_TK.sort(dim=-1)
    return probs_TK.gather(1, order_TK), indices_TK
