"""All-gather token dispatcher: every rank sees every token of the ep group and keeps the ones for its experts.

Dispatch gathers the token counts, then the tokens, routing weights and expert indices (four comm points; the
tokens are padded to the largest rank's count so ranks may hold different numbers of tokens). Each rank then
selects the (token, choice) pairs routed to its local experts. Combine weights the expert outputs by their
routing weights on the expert side, scatters them into the gathered token layout and reduce-scatters it back
(one comm point). Backward: all-gather <-> reduce-scatter; the experts' backward hands over twice more in place
of the size and index exchanges (``backward_handoffs``).

It moves ``ep`` times the tokens of an all-to-all, but needs no count exchange before the token transfer and
its collectives are the simplest ones, so it suits small ``ep`` and few tokens.

Host syncs: two per dispatch, none in the backward: the gathered token counts (after their all-gather's hand-over
and wait) and the kept rows per local expert (after the indices' all-gather), both through :func:`host_ints`. The
size all-gather is a metadata comm point: queued side work (shared experts) waits for the tokens' all-gather.

Shape legend:
    T: tokens on this rank   P: padded tokens per rank (max over ranks)   G: ep ranks   K: top-k   D: hidden
    e: local experts         R: rows for local experts, sorted by local expert
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

from lightning_moe_overlap.moe.dispatch.base import DispatcherBase
from lightning_moe_overlap.moe.dispatch.comm import all_gather, all_gather_raw, gather_sizes, reduce_scatter
from lightning_moe_overlap.moe.dispatch.host import host_ints
from lightning_moe_overlap.moe.grouped import RowSplits
from lightning_moe_overlap.moe.permute import gather_rows, scatter_weighted, sort_by_expert


@dataclass(frozen=True)
class AllGatherHandle:
    """Per-call state from :meth:`AllGatherDispatcher.dispatch` to :meth:`AllGatherDispatcher.combine`.

    Attributes:
        assign_R: ids of the kept (gathered token, choice) pairs, flat over ``[G * P, K]``, in row order.
        weights_GPK: gathered routing weights (applied on the expert side at combine).
        padded_tokens: ``P``.
        num_tokens: this rank's ``T``.
        out_dtype: dtype of the combined output.
    """

    assign_R: Tensor
    weights_GPK: Tensor
    padded_tokens: int
    num_tokens: int
    out_dtype: torch.dtype


class AllGatherDispatcher(DispatcherBase):
    """All-gather tokens over the ep group, compute the local experts, reduce-scatter the outputs."""

    name = "allgather"
    backward_handoffs = 2  # the size exchange and the all-gather of the indices

    # -- dispatch ----------------------------------------------------------------------------------------------
    def dispatch(
        self, x_TD: Tensor, indices_TK: Tensor, weights_TK: Tensor
    ) -> tuple[Tensor, RowSplits, AllGatherHandle]:
        """Gather the group's tokens, keep the rows of local experts: ``(x_RD, splits, handle)``, rows sorted by
        local expert."""
        num_tokens = x_TD.shape[0]
        padded = self._dispatch_preprocess(num_tokens, x_TD.device)
        x_GPD, weights_GPK, indices_GPK = self._token_dispatch(x_TD, indices_TK, weights_TK, padded)
        x_RD, counts, assign_R = self._dispatch_postprocess(x_GPD, indices_GPK)
        handle = AllGatherHandle(
            assign_R=assign_R,
            weights_GPK=weights_GPK,
            padded_tokens=padded,
            num_tokens=num_tokens,
            out_dtype=x_TD.dtype,
        )
        return x_RD, RowSplits.of(counts), handle

    def _dispatch_preprocess(self, num_tokens: int, device: torch.device) -> int:
        """Comm point (metadata only): the largest token count of the group, to pad every rank to it."""
        return max(gather_sizes(num_tokens, self.ep_group, self.runtime, device))

    def _token_dispatch(
        self, x_TD: Tensor, indices_TK: Tensor, weights_TK: Tensor, padded: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Comm points: all-gather tokens, weights and indices (padding rows are routed nowhere)."""
        pad = padded - x_TD.shape[0]
        x_PD = F.pad(x_TD, (0, 0, 0, pad))
        weights_PK = F.pad(weights_TK, (0, 0, 0, pad))
        indices_PK = F.pad(indices_TK.long(), (0, 0, 0, pad), value=self.num_experts)
        x_GPD = all_gather(x_PD, self.ep_group, self.runtime)
        weights_GPK = all_gather(weights_PK, self.ep_group, self.runtime)
        indices_GPK = all_gather_raw(indices_PK, self.ep_group, self.runtime)
        return x_GPD, weights_GPK, indices_GPK

    def _dispatch_postprocess(self, x_GPD: Tensor, indices_GPK: Tensor) -> tuple[Tensor, list[int], Tensor]:
        """No comm: keep the pairs routed to local experts, sorted by local expert."""
        local_GPK = indices_GPK - self.first_expert  # non-local experts fall outside [0, e) and count as dropped
        order, counts_e = sort_by_expert(local_GPK, self.num_local_experts)
        # NOTE: D2H sync (rows per local expert), after the indices' all-gather: its hand-over and wait
        counts = host_ints(counts_e, self.runtime)
        assign_R = order[: sum(counts)]
        return gather_rows(x_GPD, assign_R, indices_GPK.shape[-1]), counts, assign_R

    # -- combine -----------------------------------------------------------------------------------------------
    def combine(self, y_RD: Tensor, handle: AllGatherHandle) -> Tensor:
        """Weight and sum the local experts' outputs per gathered token, then reduce-scatter: ``out_TD``."""
        partial_GPD = self._combine_preprocess(y_RD, handle)
        out_PD = self._token_combine(partial_GPD)
        return self._combine_postprocess(out_PD, handle)

    def _combine_preprocess(self, y_RD: Tensor, handle: AllGatherHandle) -> Tensor:
        """No comm: this rank's share of every gathered token's output."""
        num_rows = handle.weights_GPK.shape[0]
        return scatter_weighted(y_RD, handle.assign_R, handle.weights_GPK, num_rows, handle.out_dtype)

    def _token_combine(self, partial_GPD: Tensor) -> Tensor:
        """Comm point: sum the shares over the group, each rank keeping its own tokens."""
        return reduce_scatter(partial_GPD, self.ep_group, self.runtime)

    def _combine_postprocess(self, out_PD: Tensor, handle: AllGatherHandle) -> Tensor:
        """No comm: drop the padding rows."""
        return out_PD[: handle.num_tokens]
