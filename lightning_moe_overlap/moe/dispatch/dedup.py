"""Deduplicated dispatch for the all-to-all dispatcher: one row per (token, destination rank), not per choice.

When several of a token's top-k experts live on the same ep rank, the plain all-to-all sends that token once per
expert. Here the source sends it once per destination rank, with its routing weights and the local expert index
of every choice (``-1``-like markers for the choices that go elsewhere); the destination expands the rows to
(token, expert) rows for its experts, and on the way back sums the weighted outputs of one token's local experts
before sending one row per (token, rank) back, where the source adds up one row per rank. DeepEP's dispatch does
the same.

The rows the experts see are exactly those of the plain path (same rows, same order: grouped by local expert,
then by source rank, then in token order; on CPU by source rank, then local expert), and every sum runs in the
same order (a token's experts in increasing global index: first inside a rank, then over ranks), so results are
bitwise equal to the plain path up to top-2, and equal up to float rounding beyond (``c1 + (c2 + c3)`` where two
later choices share a rank; docs/dispatchers.md). Every sum here and in :mod:`~lightning_moe_overlap.moe.permute`
adds its rows one after the other in index order, without atomics on CUDA, so each path gives the same bits on
every run and on CPU and CUDA alike.

FP8 dispatch (``docs/fp8.md``) works here as on the plain path: each unique row is quantised once (e4m3 and a
float32 scale per row, ``D + 4`` bytes) and sent with its routing data at the same comm point
(:func:`exchange_rows`); the destination repeats the bytes and scales per (row, local expert) (:func:`expand_rows`),
so the experts get the :class:`~lightning_moe_overlap.float8.rows.Float8Rows` the plain path gives them. The combine and
every backward exchange stay in high precision.

Shape legend:
    T: tokens on this rank   K: top-k   D: hidden size   G: ep ranks   e: local experts per rank
    U: unique (token, destination) rows sent, grouped by destination rank then token
    M: unique rows received, grouped by source rank then token   R: (row, local expert) pairs, by local expert
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_moe_overlap.float8.recipes import Float8Recipe
from lightning_moe_overlap.float8.rows import Float8Rows
from lightning_moe_overlap.moe.dispatch.comm import all_to_all_many
from lightning_moe_overlap.moe.dispatch.float8 import float8_all_to_all_many, gather_float8_rows
from lightning_moe_overlap.moe.permute import count_per_expert, gather_rows, sum_rows, take_rows
from lightning_moe_overlap.overlap.runtime import CommRuntime


def kept_per_expert(indices_TK: Tensor, num_experts: int) -> Tensor:
    """Kept assignments per expert (on the device); dropped ones (outside ``[0, num_experts)``) are not counted."""
    flat = indices_TK.reshape(-1).long()
    kept = (flat >= 0) & (flat < num_experts)
    return count_per_expert(torch.where(kept, flat, torch.full_like(flat, num_experts)), num_experts + 1)[:num_experts]


def destinations(indices_TK: Tensor, num_local: int, ep_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """No comm: where each token goes, once per destination rank.

    Args:
        indices_TK: global expert of each (token, choice); values outside ``[0, ep_size * num_local)`` are dropped.
        num_local: experts per rank ``e``.
        ep_size: ranks ``G``.

    Returns:
        ``(dest_TK, order_GT, rows_G)``: the destination rank of each choice (``G`` for dropped ones), the flat
        ``g * T + t`` ids of the (destination, token) pairs that carry a row, first and in that order (the rest
        after them), and the number of rows per destination (on the device).
    """
    num_tokens = indices_TK.shape[0]
    flat = indices_TK.long()
    kept = (flat >= 0) & (flat < num_local * ep_size)
    dest_TK = torch.where(kept, torch.div(flat, num_local, rounding_mode="floor"), torch.full_like(flat, ep_size))
    token_TK = torch.arange(num_tokens, device=flat.device).unsqueeze(-1).expand_as(dest_TK)
    present = torch.zeros((ep_size + 1) * num_tokens, dtype=torch.long, device=flat.device)
    present.scatter_(0, (dest_TK * num_tokens + token_TK).reshape(-1), 1)
    present_GT = present[: ep_size * num_tokens]
    order_GT = torch.argsort(1 - present_GT, stable=True)  # rows first, (destination, token) order kept
    return dest_TK, order_GT, present_GT.view(ep_size, num_tokens).sum(1)


def local_choices(indices_TK: Tensor, dest_TK: Tensor, token_U: Tensor, dest_U: Tensor, num_local: int) -> Tensor:
    """No comm: per unique row, the destination's local expert of each choice, ``num_local`` where it goes elsewhere.

    Sent as int32 (the receiving rank's ``sort_by_expert`` treats ``num_local`` as dropped).
    """
    here_UK = dest_TK.index_select(0, token_U) == dest_U.unsqueeze(-1)
    local_UK = indices_TK.long().index_select(0, token_U) - dest_U.unsqueeze(-1) * num_local
    return torch.where(here_UK, local_UK, torch.full_like(local_UK, num_local)).to(torch.int32)


def exchange_layout(counts_E: Tensor, rows_G: Tensor, num_local: int) -> Tensor:
    """The count exchange's payload ``[G, e + 1]``: per destination, the rows of each of its experts, then the
    unique rows it receives."""
    return torch.cat([counts_E.view(-1, num_local), rows_G.unsqueeze(-1)], dim=1)


def pack_choices(weights_UK: Tensor, local_UK: Tensor) -> tuple[Tensor, ...]:
    """The per-row routing data to send: one ``[U, 2K]`` tensor (weights, then local indices as exact floats) when
    the weights are float32 or float64, else the weights and the int32 indices apart (one collective more)."""
    if weights_UK.dtype in (torch.float32, torch.float64):
        return (torch.cat([weights_UK, local_UK.to(weights_UK.dtype)], dim=1),)
    return weights_UK, local_UK


def unpack_choices(received: tuple[Tensor, ...], top_k: int) -> tuple[Tensor, Tensor]:
    """``(weights_MK, local_MK)`` from what :func:`pack_choices` sent (the weights keep their autograd graph)."""
    if len(received) == 1:
        return received[0][:, :top_k], received[0][:, top_k:].long()
    return received[0], received[1]


def token_rows(x_TD: Tensor, token_U: Tensor, ep_size: int) -> Tensor:
    """No comm: the row of each (token, destination) pair, ``x_TD[token_U]`` (differentiable; a token is taken at
    most once per rank, and the backward adds its ``<= G`` gradients without atomics)."""
    return take_rows(x_TD, token_U, ep_size)


def exchange_rows(
    x_UD: Tensor,
    choices: tuple[Tensor, ...],
    fp8: Float8Recipe | None,
    output_splits: Sequence[int],
    input_splits: Sequence[int],
    group: ProcessGroup | None,
    runtime: CommRuntime | None,
) -> tuple[Tensor, ...]:
    """Comm point: the unique rows and their routing data (:func:`pack_choices`) in one exchange,
    ``(x_MD, *choices_M)``. ``fp8``: the rows go in FP8 (``x_MD`` is a
    :class:`~lightning_moe_overlap.float8.rows.Float8Rows`, ``float8.py``); the gradients come back in high
    precision."""
    if fp8 is None:
        return all_to_all_many((x_UD, *choices), output_splits, input_splits, group, runtime)
    return float8_all_to_all_many(x_UD, choices, fp8, tuple(output_splits), tuple(input_splits), group, runtime)


def expand_rows(x_MD: Tensor, assign_R: Tensor, top_k: int) -> Tensor:
    """No comm: the received row of each (row, local expert) pair, ``x_MD[assign_R // K]`` (differentiable); FP8
    rows stay FP8 (their bytes and scales repeated)."""
    if isinstance(x_MD, Float8Rows):
        return gather_float8_rows(x_MD, assign_R, top_k)
    return gather_rows(x_MD, assign_R, top_k)


def sum_per_token(y_UD: Tensor, token_U: Tensor, num_tokens: int, ep_size: int) -> Tensor:
    """No comm: add the rows returned by each rank into their tokens, in rank order and without atomics
    (differentiable): ``out_TD``. A token gets at most one row per rank (``ep_size`` rows)."""
    return sum_rows(y_UD, token_U, num_tokens, ep_size)
