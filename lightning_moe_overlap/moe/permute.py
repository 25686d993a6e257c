"""Sorting routed assignments by expert and scattering expert outputs back to their tokens (no communication).

An *assignment* is one (token, choice) pair of the router's top-k, flattened as ``a = t * K + k``. Assignments
whose expert index lies outside ``[0, num_experts)`` are *dropped*: they are never computed and contribute zero.
Hugging Face experts modules mark such entries with ``num_experts``; DeepEP uses ``-1``; both count as dropped.

Shape legend:
    T: tokens on this rank          K: top-k choices per token      D: hidden size
    E: experts counted by the caller (global or local)               A: kept assignments (<= T * K)
"""

from __future__ import annotations

import torch
from torch import Tensor


def sort_by_expert(indices_TK: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """Order every assignment by expert (stable: token order inside one expert), dropped ones last.

    Args:
        indices_TK: expert index of each (token, choice); values outside ``[0, num_experts)`` are dropped.
        num_experts: number of experts ``E``.

    Returns:
        ``(order_TK, counts_E)``: the flat assignment ids sorted by expert with the dropped ones at the end
        (length ``T*K``), and the number of kept assignments per expert. ``order_TK[:counts_E.sum()]`` are the
        kept assignments; slicing needs the count on the host, which the caller fetches together with its other
        host-side sizes.
    """
    flat = indices_TK.reshape(-1).long()
    kept = (flat >= 0) & (flat < num_experts)
    key = torch.where(kept, flat, torch.full_like(flat, num_experts))
    order = torch.argsort(key, stable=True)
    return order, count_per_expert(key, num_experts + 1)[:num_experts]


def count_per_expert(expert_A: Tensor, num_bins: int) -> Tensor:
    """How many entries of ``expert_A`` (values in ``[0, num_bins)``) fall in each bin, as int64, on the device.

    ``torch.bincount`` would read the maximum back to the host on CUDA (a sync); a scatter-add into zeros of the
    known size does not, and it is exact (integer) and deterministic.
    """
    counts = torch.zeros(num_bins, dtype=torch.long, device=expert_A.device)
    return counts.scatter_add_(0, expert_A, torch.ones_like(expert_A))


def gather_rows(x_TD: Tensor, assign_A: Tensor, top_k: int) -> Tensor:
    """The token row of each assignment: ``x_AD[i] = x_TD[assign_A[i] // K]`` (differentiable)."""
    return x_TD.index_select(0, torch.div(assign_A, top_k, rounding_mode="floor"))


def scatter_weighted(
    y_AD: Tensor, assign_A: Tensor, weights_TK: Tensor, num_tokens: int, out_dtype: torch.dtype
) -> Tensor:
    """Weight each assignment's output by its routing weight and sum per token: ``out_TD`` (differentiable).

    Matches Hugging Face experts modules: the product is taken in the promoted dtype of output and weight, then
    cast to ``out_dtype`` before the per-token sum. Tokens with no kept assignment get zeros.
    """
    top_k = weights_TK.shape[-1]
    w_A = weights_TK.reshape(-1).index_select(0, assign_A)
    contrib_AD = (y_AD * w_A.unsqueeze(-1)).to(out_dtype)
    out_TD = torch.zeros(num_tokens, y_AD.shape[-1], dtype=out_dtype, device=y_AD.device)
    return out_TD.index_add(0, torch.div(assign_A, top_k, rounding_mode="floor"), contrib_AD)


def chunk_permutation(counts_SE: Tensor, total: int) -> Tensor:
    """Row order that turns source-major chunks ``[s][e]`` into expert-major chunks ``[e][s]``.

    Rows received from an all-to-all arrive grouped by source rank ``s`` and, inside, by local expert ``e``.
    The grouped GEMM wants them grouped by expert. ``rows[perm]`` is the expert-major layout and
    ``inverse_permutation(perm)`` undoes it. Built on the counts' device without a host sync: the only host value
    it needs, ``total``, the caller already holds (the sum of the all-to-all's output splits).

    Args:
        counts_SE: row counts ``[S, E]``, one row of ``E`` counts per source (int64, on the rows' device).
        total: ``counts_SE.sum()``, known on the host.
    """
    counts = counts_SE.long()
    flat_SE = counts.reshape(-1)
    starts_SE = torch.cumsum(flat_SE, 0) - flat_SE  # where each [s][e] chunk begins in the received rows
    counts_ES = counts.t().reshape(-1)
    starts_ES = starts_SE.reshape(counts.shape).t().reshape(-1)
    out_starts_ES = torch.cumsum(counts_ES, 0) - counts_ES  # where each chunk begins in the expert-major rows
    device = counts.device
    within = torch.arange(total, device=device) - torch.repeat_interleave(out_starts_ES, counts_ES, output_size=total)
    return torch.repeat_interleave(starts_ES, counts_ES, output_size=total) + within


def inverse_permutation(perm: Tensor) -> Tensor:
    """``inv`` with ``inv[perm[i]] = i``."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv
