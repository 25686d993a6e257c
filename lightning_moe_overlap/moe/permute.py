"""Sorting routed assignments by expert and scattering expert outputs back to their tokens (no communication).

An *assignment* is one (token, choice) pair of the router's top-k, flattened as ``a = t * K + k``. Assignments
whose expert index lies outside ``[0, num_experts)`` are *dropped*: they are never computed and contribute zero.
Hugging Face experts modules mark such entries with ``num_experts``; DeepEP uses ``-1``; both count as dropped.

Sums without atomics. Where several assignments add into one token (the combine, and the backward of the
gather), each one is first written to its own row of a ``[K, T, D]`` buffer (its *slot*: its rank among the
token's assignments, in list order), then the ``K`` slots are added one after the other (16-bit rows in float32,
rounded once). No two writes meet, so no atomic add runs on CUDA, and the additions are those of
``zeros.index_add_(0, token_A, rows)`` on CPU, in the same order: results are bitwise the same on every run, on
CPU and CUDA alike. On CPU, whose ``index_add_`` already adds in index order, the sums are that one call.

Shape legend:
    T: tokens on this rank          K: top-k choices per token      D: hidden size
    E: experts counted by the caller (global or local)               A: kept assignments (<= T * K)
    N: target rows of a sum         S: slots (most entries of one target row)
"""

from __future__ import annotations

import torch
from torch import Tensor


_REDUCED = {torch.bfloat16: torch.float32, torch.float16: torch.float32}  # the dtype 16-bit sums run in


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
    key = expert_key(indices_TK, num_experts)
    order = torch.argsort(key, stable=True)
    return order, count_per_expert(key, num_experts + 1)[:num_experts]


def expert_key(indices_TK: Tensor, num_experts: int) -> Tensor:
    """The flat expert ids as int64 with every id outside ``[0, E)`` (a dropped choice) set to ``E``: clamped into
    ``[-1, E]``, then ``-1`` wraps to ``E`` (two ops where a mask and a ``where`` take five)."""
    return indices_TK.reshape(-1).long().clamp(-1, num_experts).remainder(num_experts + 1)


def count_per_expert(expert_A: Tensor, num_bins: int) -> Tensor:
    """How many entries of ``expert_A`` (values in ``[0, num_bins)``) fall in each bin, as int64, on the device.

    ``torch.bincount`` would read the maximum back to the host on CUDA (a sync); a scatter-add into zeros of the
    known size does not, and it is exact (integer) and deterministic.
    """
    counts = torch.zeros(num_bins, dtype=torch.long, device=expert_A.device)
    return counts.scatter_add_(0, expert_A, torch.ones_like(expert_A))


def gather_rows(x_TD: Tensor, assign_A: Tensor, top_k: int, token_A: Tensor | None = None) -> Tensor:
    """The token row of each assignment: ``x_AD[i] = x_TD[assign_A[i] // K]`` (differentiable; the backward sums
    a token's ``<= K`` row gradients without atomics). ``token_A``: :func:`token_of` of ``assign_A``, when the
    caller has it."""
    return take_rows(x_TD, token_of(assign_A, top_k) if token_A is None else token_A, top_k)


def token_of(assign_A: Tensor, top_k: int) -> Tensor:
    """The token of each flat (token, choice) id: ``assign_A // K``."""
    return torch.div(assign_A, top_k, rounding_mode="floor")


def take_rows(x_ND: Tensor, row_A: Tensor, max_per_row: int) -> Tensor:
    """``x_ND[row_A]`` (differentiable), where no row is taken more than ``max_per_row`` times; the backward is
    :func:`sum_rows`, not ``index_select``'s atomic ``index_add_``."""
    return _TakeRows.apply(x_ND, row_A, max_per_row)


def sum_rows(src_AD: Tensor, row_A: Tensor, num_rows: int, max_per_row: int) -> Tensor:
    """``out_ND[n] = sum of src_AD[i] with row_A[i] == n``, added in list order (differentiable), where no row
    receives more than ``max_per_row`` entries. The values of ``zeros.index_add_(0, row_A, src_AD)`` on CPU, with
    no atomics on CUDA."""
    return _SumRows.apply(src_AD, row_A, num_rows, max_per_row)


def appearance_slots(row_A: Tensor, num_rows: int) -> Tensor:
    """Each entry's rank among the entries of its row, in list order: ``slot_A[i] = #{j < i: row_A[j] == row_A[i]}``
    (on the device, no host sync)."""
    order_A = torch.argsort(row_A, stable=True)  # by row, list order kept inside a row
    counts_N = count_per_expert(row_A, num_rows)
    starts_N = torch.cumsum(counts_N, 0) - counts_N
    rank_A = torch.arange(row_A.numel(), device=row_A.device) - starts_N.index_select(0, row_A.index_select(0, order_A))
    return torch.empty_like(rank_A).index_copy_(0, order_A, rank_A)


def index_add_is_ordered(device: torch.device) -> bool:
    """Whether ``index_add_`` on ``device`` adds in index order without atomics (CPU): there one pass gives the
    same sums as the slots, without the ``[S, N, D]`` buffer."""
    return device.type == "cpu"


def _sum_by_slot(src_AD: Tensor, row_A: Tensor, num_rows: int, slots: int) -> Tensor:
    """Write each entry to its own ``(slot, row)`` of a zeroed ``[S, N, D]`` buffer, then add the slots in order
    (where ``index_add_`` is ordered, one ``index_add_``: the same values)."""
    dim = src_AD.shape[-1]
    if index_add_is_ordered(src_AD.device):
        return src_AD.new_zeros(num_rows, dim).index_add_(0, row_A, src_AD)
    buffer_SND = src_AD.new_zeros(slots, num_rows, dim)
    target_A = row_A if slots == 1 else appearance_slots(row_A, num_rows) * num_rows + row_A  # no two writes meet
    buffer_SND.view(-1, dim).index_copy_(0, target_A, src_AD)
    if slots == 1:
        return buffer_SND[0]
    # A fresh [N, D] (the buffer is freed on return); 16-bit rows are added in float32 and rounded once, as CPU's
    # index_add_ does.
    out_ND = buffer_SND[0].to(_REDUCED.get(src_AD.dtype, src_AD.dtype), copy=True)
    for slot in range(1, slots):
        out_ND.add_(buffer_SND[slot])
    return out_ND.to(src_AD.dtype)


class _TakeRows(torch.autograd.Function):
    """``x_ND[row_A]``; its backward sums each row's gradients slot by slot (:func:`sum_rows`)."""

    @staticmethod
    def forward(ctx, x_ND: Tensor, row_A: Tensor, max_per_row: int) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(row_A)
        ctx.num_rows, ctx.max_per_row = x_ND.shape[0], max_per_row
        return x_ND.index_select(0, row_A)

    @staticmethod
    def backward(ctx, g_AD: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        (row_A,) = ctx.saved_tensors
        return _SumRows.apply(g_AD, row_A, ctx.num_rows, ctx.max_per_row), None, None


class _SumRows(torch.autograd.Function):
    """:func:`sum_rows`; its backward is the gather ``g_ND[row_A]`` (:func:`take_rows`)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, src_AD: Tensor, row_A: Tensor, num_rows: int, max_per_row: int
    ) -> Tensor:
        ctx.save_for_backward(row_A)
        ctx.max_per_row = max_per_row
        return _sum_by_slot(src_AD, row_A, num_rows, max_per_row)

    @staticmethod
    def backward(ctx, g_ND: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        (row_A,) = ctx.saved_tensors
        return _TakeRows.apply(g_ND, row_A, ctx.max_per_row), None, None, None


def scatter_weighted(
    y_AD: Tensor, assign_A: Tensor, weights_TK: Tensor, num_tokens: int, out_dtype: torch.dtype,
    token_A: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """Weight each assignment's output by its routing weight and sum per token: ``out_TD`` (differentiable).

    Matches Hugging Face experts modules: the product is taken in the promoted dtype of output and weight, then
    cast to ``out_dtype`` before the per-token sum. Tokens with no kept assignment get zeros. ``token_A``:
    :func:`token_of` of ``assign_A``, when the caller has it.
    """
    top_k = weights_TK.shape[-1]
    w_A = take_rows(weights_TK.reshape(-1, 1), assign_A, 1).view(-1)  # ids are unique: one entry per weight
    token_A = token_of(assign_A, top_k) if token_A is None else token_A
    return _WeightedScatter.apply(y_AD, w_A, token_A, num_tokens, out_dtype, top_k)


class _WeightedScatter(torch.autograd.Function):
    """``out_TD[token_A[a]] += (y_AD[a] * w_A[a])``, summed slot by slot (no atomics: the module docstring).

    The same values as ``zeros.index_add(token_A, (y_AD * w_A[:, None]).to(out_dtype))`` under autograd on CPU,
    with, in backward, the rows' gradient scaled in place (one ``[A, D]`` allocation fewer per call).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, y_AD: Tensor, w_A: Tensor, token_A: Tensor, num_tokens: int, out_dtype: torch.dtype, top_k: int
    ) -> Tensor:
        product_AD = y_AD * w_A.unsqueeze(-1)
        contrib_AD = product_AD.to(out_dtype)
        ctx.save_for_backward(y_AD, w_A, token_A)
        ctx.product_dtype = product_AD.dtype  # the promoted dtype of the two
        return _sum_by_slot(contrib_AD, token_A, num_tokens, top_k)  # [T, D]: a token has <= K assignments

    @staticmethod
    def backward(ctx, g_TD: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        y_AD, w_A, token_A = ctx.saved_tensors
        # The gradient of each assignment's product, a fresh buffer (index_select) in the product's dtype.
        g_AD = g_TD.index_select(0, token_A).to(ctx.product_dtype)
        grad_w = (g_AD * y_AD).sum(-1).to(w_A.dtype) if ctx.needs_input_grad[1] else None
        grad_y = g_AD.mul_(w_A.unsqueeze(-1)).to(y_AD.dtype) if ctx.needs_input_grad[0] else None
        return grad_y, grad_w, None, None, None, None


class _PermuteRows(torch.autograd.Function):
    """``x[perm]`` for a permutation ``perm``; its backward is the gather by the inverse (no zeros, no scatter)."""

    @staticmethod
    def forward(ctx, x_ND: Tensor, perm_N: Tensor, inverse_N: Tensor | None) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(perm_N if inverse_N is None else inverse_N)
        ctx.inverted = inverse_N is not None
        return x_ND.index_select(0, perm_N)

    @staticmethod
    def backward(ctx, g_ND: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        (saved,) = ctx.saved_tensors
        return g_ND.index_select(0, saved if ctx.inverted else inverse_permutation(saved)), None, None


def permute_rows(x_ND: Tensor, perm_N: Tensor, inverse_N: Tensor | None = None) -> Tensor:
    """``x_ND[perm_N]`` where ``perm_N`` is a permutation of the rows (differentiable).

    Same values as ``x_ND.index_select(0, perm_N)``; its backward gathers by the inverse permutation (given as
    ``inverse_N``, or built on first use), where ``index_select``'s backward zero-fills a buffer and scatter-adds.
    """
    return _PermuteRows.apply(x_ND, perm_N, inverse_N)


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
