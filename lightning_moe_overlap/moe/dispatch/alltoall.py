"""All-to-all token dispatcher: send each routed token straight to the ranks of its experts.

With ``dedup=True`` a token goes once to each rank that holds any of its experts, with its routing
weights and local expert indices, and comes back once per rank, already summed over that rank's experts
(``dedup.py``); with ``dedup=False`` (the default) each (token, choice) row travels on its own and the weights stay on the
source rank. The experts see the same rows in the same order either way.

Row layout for the experts: on CUDA the received rows are regrouped by local expert (one permutation each way),
as the grouped GEMM kernels read them. On CPU they stay in the receive layout, source rank by source rank, and
the experts get a :class:`~lightning_moe_overlap.moe.grouped.RowSplits` of segments (one per source rank and
local expert): CPU GEMMs are a loop of one matmul per group either way, so running it per segment on views of the
weights costs a few more small matmuls and saves four row permutations per layer and micro-batch (two in forward,
two in backward), each a pass over ``[R, D]`` into fresh memory (``docs/dispatchers.md``).

Per call, two comm points on the way in (the token counts, then the tokens) and one on the way out; the
backward mirrors the last two (the combine's backward is a dispatch-shaped all-to-all and vice versa), and the
experts' backward hands over once more in place of the counts (``backward_handoffs``). Routing weights
never cross the wire: they are applied on the source rank when the outputs are scattered back to their tokens.

Host syncs: one per dispatch and none in the backward: the send and receive counts that ``all_to_all_single``
needs as Python split sizes, read after the count exchange's hand-over and wait (:func:`host_ints`, marked
``NOTE: D2H sync``; ``docs/overlap.md``, "Host reads and hand-overs"). Everything else (counting, regrouping, the
combine) stays on the device. With ``static=True`` none at all: fixed slots per (rank, expert), the same number of
rows to and from every rank, counts on the device (``static_slots.py``). The count exchange is a metadata comm
point: queued side work (shared experts) waits for the token dispatch's, whose transfer can hide it.

Shape legend:
    T: tokens on this rank   K: top-k   D: hidden size   E: global experts   e: local experts   G: ep ranks
    A: rows sent by this rank (kept assignments, sorted by global expert)
    U: (dedup) rows sent, one per (destination rank, token), destination-major
    M: rows received, grouped by source rank then local expert
    R: the rows the experts get: grouped by local expert, or on CPU the ``M`` rows in their segments
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_moe_overlap._compat import torch as torch_compat
from lightning_moe_overlap.float8.recipes import Float8Recipe
from lightning_moe_overlap.moe.dispatch.base import DispatcherBase
from lightning_moe_overlap.moe.dispatch.comm import all_to_all, communicator_of, exchange_counts
from lightning_moe_overlap.moe.dispatch.dedup import (
    destinations,
    exchange_layout,
    exchange_rows,
    expand_rows,
    kept_per_expert,
    local_choices,
    pack_choices,
    sum_per_token,
    token_rows,
    unpack_choices,
)
from lightning_moe_overlap.moe.dispatch.float8 import float8_all_to_all
from lightning_moe_overlap.moe.dispatch.host import host_ints
from lightning_moe_overlap.moe.dispatch.static_slots import (
    SlotGrid,
    SlotPlan,
    SlotUsage,
    expert_major,
    fill_slots,
    plan_slots,
    read_slots,
    slot_capacity,
)
from lightning_moe_overlap.moe.grouped import RowSplits
from lightning_moe_overlap.overlap.runtime import CommRuntime
from lightning_moe_overlap.moe.permute import (
    chunk_permutation,
    gather_rows,
    inverse_permutation,
    permute_rows,
    scatter_weighted,
    sort_by_expert,
    token_of,
)


@dataclass(frozen=True)
class AllToAllHandle:
    """Per-call state from :meth:`AllToAllDispatcher.dispatch` to :meth:`AllToAllDispatcher.combine`.

    Attributes:
        assign_A: flat (token, choice) ids of the rows sent, in send order.
        token_A: the token of each (``assign_A // K``).
        weights_TK: the routing weights, applied at combine on this (source) rank.
        num_tokens: ``T``.
        out_dtype: dtype of the combined output (that of the input tokens).
        input_splits: rows sent to each ep rank.
        output_splits: rows received from each ep rank.
        perm_R: receive layout (source-major) -> expert-major rows; ``None`` when there is one source or the
            experts take the receive layout's segments (CPU).
    """

    assign_A: Tensor
    token_A: Tensor
    weights_TK: Tensor
    num_tokens: int
    out_dtype: torch.dtype
    input_splits: tuple[int, ...]
    output_splits: tuple[int, ...]
    perm_R: Tensor | None


@dataclass(frozen=True)
class StaticHandle:
    """Per-call state of a static dispatch (``static=True``, ``static_slots.py``).

    Attributes:
        plan: where this rank's assignments went (their slots, which were sent).
        weights_TK: the routing weights, applied at combine on this (source) rank.
        num_tokens: ``T``.
        out_dtype: dtype of the combined output.
        rows_per_rank: slots exchanged with each ep rank (``e * C``, the same both ways).
        perm_R: received slots -> the experts' rows (``static_slots.expert_major``).
    """

    plan: SlotPlan
    weights_TK: Tensor
    num_tokens: int
    out_dtype: torch.dtype
    rows_per_rank: int
    perm_R: Tensor


@dataclass(frozen=True)
class DedupHandle:
    """Per-call state of a deduplicated dispatch (``dedup=True``).

    Attributes:
        token_U: the token of each row sent (destination-major, token order inside a destination).
        assign_R: flat (received row, choice) ids of the rows handed to the experts, sorted by local expert (on
            CPU by source rank, then local expert: the plain path's segments).
        weights_MK: the routing weights received with the rows, applied here (the expert side) at combine.
        num_tokens: ``T``.
        out_dtype: dtype of the combined output (that of the input tokens).
        input_splits: rows sent to each ep rank.
        output_splits: rows received from each ep rank.
    """

    token_U: Tensor
    assign_R: Tensor
    weights_MK: Tensor
    num_tokens: int
    out_dtype: torch.dtype
    input_splits: tuple[int, ...]
    output_splits: tuple[int, ...]


class AllToAllDispatcher(DispatcherBase):
    """Uneven ``all_to_all_single`` over the ep group (gloo or NCCL).

    Args:
        ep_group: the expert-parallel process group; ``None`` for a single process.
        num_experts: global number of experts (divisible by the group size).
        runtime: comm-point hand-over target; ``None`` runs without any overlap engine.
        dedup: send a token once per destination rank, not once per (token, expert) (see ``dedup.py``). Applies
            with top-k > 1 and rows leaving the process (ep > 1, or a simulated-ep loopback); otherwise the plain
            path runs, with bitwise the same result.
        static: fixed-size slots per (rank, expert) and device-side counts: no host read per call
            (``static_slots.py``). Slots hold :attr:`slot_capacity_factor`'s capacity (the layer's capacity
            factor, which ``apply_expert_parallel`` sets), or every token when it is ``None``.
    """

    name = "alltoall"
    knobs = ("dedup", "static")
    backward_handoffs = 1  # the token-count exchange
    fp8_dispatch = True  # `dispatch(..., fp8=recipe)` sends the rows in FP8 (deduplicated or not)

    def __init__(
        self,
        ep_group: ProcessGroup | None,
        num_experts: int,
        runtime: CommRuntime | None,
        dedup: bool = False,
        static: bool = False,
    ) -> None:
        super().__init__(ep_group, num_experts, runtime)
        for knob, value, what in (("dedup", dedup, "deduplicated"), ("static", static, "static")):
            if not isinstance(value, bool):
                raise TypeError(
                    f"`AllToAllDispatcher`: {knob}={value!r} is a {type(value).__name__}, not a bool; it switches the "
                    f"{what} dispatch on or off. Pass {knob}=True or {knob}=False (default)."
                )
        if dedup and static:
            raise ValueError(
                "`AllToAllDispatcher`: dedup=True and static=True; the static layout sends one row per (token, "
                "expert) in fixed slots, the deduplicated one a row per (token, rank) in sizes read on the host. "
                "Pick one of them."
            )
        self.dedup = dedup
        self.static = static
        # The capacity factor the static slots hold (the one the layer drops with); None: every token.
        self.slot_capacity_factor: float | None = None
        self._usage: Tensor | None = None  # [rows, dropped] of the static dispatches counted, on the device
        self._calls, self._slots = 0, 0  # ... and their number and slots, known on the host
        self._grids: dict[tuple[int, torch.device], SlotGrid] = {}  # per slot capacity (and device)

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", dedup={self.dedup}, static={self.static})"

    # -- dispatch ----------------------------------------------------------------------------------------------
    def dispatch(
        self, x_TD: Tensor, indices_TK: Tensor, weights_TK: Tensor, fp8: Float8Recipe | None = None
    ) -> tuple[Tensor, RowSplits, AllToAllHandle | DedupHandle | StaticHandle]:
        """Send rows to their experts' ranks; returns ``(x_RD, splits, handle)``.

        ``splits``: the rows of each local expert, sorted by local expert or, on CPU with more than one rank, in the
        receive layout's segments (see the module docstring). ``fp8``: send the rows in FP8, quantised for this
        recipe's experts (``x_RD`` is then a :class:`~lightning_moe_overlap.float8.rows.Float8Rows`, ``float8.py``), on
        the deduplicated path too (each unique row quantised once, ``dedup.py``).
        """
        if self.static:
            if fp8 is not None:
                raise NotImplementedError(
                    "`AllToAllDispatcher(static=True)`: the rows cannot travel in FP8 in the static layout; the FP8 "
                    "dispatch sizes its scales on the host. Dispatch in high precision (fp8_dispatch=False) or use "
                    "static=False."
                )
            return self._dispatch_static(x_TD, indices_TK, weights_TK)
        if self.dedup and self._worth_deduplicating(indices_TK.shape[-1]):
            return self._dispatch_dedup(x_TD, indices_TK, weights_TK, fp8)
        order_TK, counts_E = self._dispatch_preprocess(indices_TK)
        send_E, recv_SE, recv_GE = self._exchange_counts(counts_E)
        assign_A = order_TK[: sum(send_E)]
        token_A = token_of(assign_A, indices_TK.shape[-1])
        x_AD = gather_rows(x_TD, assign_A, indices_TK.shape[-1], token_A)
        input_splits = tuple(
            sum(send_E[r * self.num_local_experts : (r + 1) * self.num_local_experts]) for r in range(self.ep_size)
        )
        output_splits = tuple(sum(row) for row in recv_SE)
        if fp8 is not None:
            x_RD, perm_R, splits = self._token_dispatch_fp8(x_AD, fp8, input_splits, output_splits, recv_SE, recv_GE)
        else:
            x_MD = self._token_dispatch(x_AD, input_splits, output_splits)
            if self._segments(x_MD):
                x_RD, perm_R, splits = x_MD, None, self._receive_segments(recv_SE)
            else:
                x_RD, perm_R = self._dispatch_postprocess(x_MD, recv_GE)
                splits = self._expert_splits(recv_SE)
        handle = AllToAllHandle(
            assign_A=assign_A,
            token_A=token_A,
            weights_TK=weights_TK,
            num_tokens=x_TD.shape[0],
            out_dtype=x_TD.dtype,
            input_splits=input_splits,
            output_splits=output_splits,
            perm_R=perm_R,
        )
        return x_RD, splits, handle

    def _dispatch_static(
        self, x_TD: Tensor, indices_TK: Tensor, weights_TK: Tensor
    ) -> tuple[Tensor, RowSplits, StaticHandle]:
        """The static dispatch (``static_slots.py``): the same comm points as the plain one, no host read."""
        num_tokens, top_k = indices_TK.shape
        local, ranks = self.num_local_experts, self.ep_size
        capacity = slot_capacity(num_tokens, top_k, self.num_experts, self.slot_capacity_factor)
        # Preprocess (no comm): every assignment's slot.
        plan = plan_slots(indices_TK, self.num_experts, capacity)
        meta_GE1 = torch.cat([plan.sent_E.view(ranks, local), plan.sent_E.new_full((ranks, 1), num_tokens)], dim=1)
        # Comm point: the rows each rank will find in its slots, and every rank's token count.
        recv_GE1 = exchange_counts(meta_GE1, self.ep_group, self.runtime)
        if ranks > 1:
            torch_compat.assert_async(
                (recv_GE1[:, local] == num_tokens).all(),
                f"`AllToAllDispatcher(static=True)`: this rank holds {num_tokens} tokens in this micro-batch and "
                "another ep rank a different number; the static layout sizes its slots from the token count, so "
                "every ep rank must hold as many (fixed-length micro-batches). Pad every batch to one sequence "
                "length (e.g. in the DataLoader's collate function), or turn the static layout off "
                "(MoEOverlapStrategy(alltoall_static=False); static=False on a dispatcher).",
            )
        recv_GE = recv_GE1[:, :local]
        # Comm point: the slots, the same number to and from every rank (no sizes read on the host).
        rows_per_rank = local * capacity
        splits_G = [rows_per_rank] * ranks
        x_MD = all_to_all(fill_slots(x_TD, plan, top_k, self.num_experts * capacity), splits_G, splits_G,
                          self.ep_group, self.runtime)  # fmt: skip
        # Postprocess (no comm): the rows that hold a token by local expert, then the empty slots.
        perm_R = expert_major(recv_GE, self._grid(capacity, x_TD.device))
        self._count_usage(plan, capacity)
        handle = StaticHandle(plan, weights_TK, num_tokens, x_TD.dtype, rows_per_rank, perm_R)
        return permute_rows(x_MD, perm_R), RowSplits.padded(recv_GE.sum(0)), handle

    def _grid(self, capacity: int, device: torch.device) -> SlotGrid:
        """The fixed index tensors of the receive layout at ``capacity`` (a few capacities: micro-batch lengths)."""
        key = (capacity, device)
        if key not in self._grids:
            if len(self._grids) >= 8:  # lengths keep changing: keep the newest few
                self._grids.pop(next(iter(self._grids)))
            self._grids[key] = SlotGrid.build(self.ep_size, self.num_local_experts, capacity, device)
        return self._grids[key]

    def _count_usage(self, plan: SlotPlan, capacity: int) -> None:
        """Add this call's rows, slots and drops to the running usage (device adds, no host read)."""
        call = torch.stack([plan.sent_E, plan.over_E]).sum(1)
        self._usage = call if self._usage is None else self._usage + call
        self._calls += 1
        self._slots += self.num_experts * capacity

    def static_usage(self, reset: bool = True) -> SlotUsage:
        """The static dispatches' rows, slots and drops since the last reset (one host read: call it at a logging
        step, not per micro-batch)."""
        rows, dropped = (0, 0) if self._usage is None else self._usage.tolist()  # NOTE: D2H sync (on request)
        usage = SlotUsage(self._calls, int(rows), self._slots, int(dropped))
        if reset:
            self._usage, self._calls, self._slots = None, 0, 0
        return usage

    def _expert_splits(self, recv_SE: list[list[int]]) -> RowSplits:
        """The rows of each local expert, sorted by local expert."""
        return RowSplits.of([sum(row[e] for row in recv_SE) for e in range(self.num_local_experts)])

    def _token_dispatch_fp8(
        self,
        x_AD: Tensor,
        recipe: Float8Recipe,
        input_splits: tuple[int, ...],
        output_splits: tuple[int, ...],
        recv_SE: list[list[int]],
        recv_GE: Tensor,
    ) -> tuple[Tensor, Tensor | None, RowSplits]:
        """Comm point, then postprocess: the rows in FP8 with their scales (``float8.py``), regrouped by local
        expert unless the experts take the receive layout's segments; ``(x_RD, perm_R, splits)``."""
        segments = self.ep_size > 1 and x_AD.device.type == "cpu"  # `_segments`, before any row is received
        perm_R = None
        if self.ep_size > 1 and not segments:
            perm_R = chunk_permutation(recv_GE, sum(output_splits))
        x_RD = float8_all_to_all(x_AD, recipe, output_splits, input_splits, self.ep_group, self.runtime, perm_R)
        return x_RD, perm_R, self._receive_segments(recv_SE) if segments else self._expert_splits(recv_SE)

    def _segments(self, x_MD: Tensor) -> bool:
        """Whether the experts take the received rows in their segments rather than regrouped (CPU, several
        sources: see the module docstring)."""
        return self.ep_size > 1 and x_MD.device.type == "cpu"

    def _receive_segments(self, recv_SE: list[list[int]]) -> RowSplits:
        """The segments of the receive layout: source rank by source rank, local expert by local expert."""
        local = self.num_local_experts
        experts = [e for _ in range(self.ep_size) for e in range(local)]
        return RowSplits.from_segments(experts, [n for row in recv_SE for n in row[:local]], local)

    def _worth_deduplicating(self, top_k: int) -> bool:
        """Whether a deduplicated dispatch can save anything: two or more choices per token, and rows that leave
        the process (the communicator exchanges them: more than one rank, or a stand-in for the others). Otherwise
        both paths give bitwise the same result and the plain one does less."""
        return top_k > 1 and communicator_of(self.runtime).exchanges(self.ep_group)

    def _dispatch_dedup(
        self, x_TD: Tensor, indices_TK: Tensor, weights_TK: Tensor, fp8: Float8Recipe | None = None
    ) -> tuple[Tensor, RowSplits, DedupHandle]:
        """The deduplicated dispatch: the same stages, one row per (token, destination rank); ``fp8``: the rows
        travel in FP8 (:func:`~lightning_moe_overlap.moe.dispatch.dedup.exchange_rows`)."""
        num_tokens, top_k, local = x_TD.shape[0], indices_TK.shape[-1], self.num_local_experts
        # Preprocess (no comm): rows per expert, and which (destination, token) pairs carry a row.
        counts_E = kept_per_expert(indices_TK, self.num_experts)
        dest_TK, order_GT, rows_G = destinations(indices_TK, local, self.ep_size)
        # Comm point: per destination, its experts' assignments and its unique rows.
        recv_GC = exchange_counts(exchange_layout(counts_E, rows_G, local), self.ep_group, self.runtime)
        # NOTE: D2H sync (the all-to-all's splits), after the count exchange's hand-over and wait
        sizes = host_ints(torch.cat([rows_G, recv_GC.reshape(-1)]), self.runtime)
        input_splits = tuple(sizes[: self.ep_size])
        recv_SC = [sizes[self.ep_size + s * (local + 1) :][: local + 1] for s in range(self.ep_size)]
        output_splits = tuple(row[local] for row in recv_SC)
        row_U = order_GT[: sum(input_splits)]
        token_U = torch.remainder(row_U, max(num_tokens, 1))
        dest_U = torch.div(row_U, max(num_tokens, 1), rounding_mode="floor")
        choices = pack_choices(
            token_rows(weights_TK, token_U, self.ep_size), local_choices(indices_TK, dest_TK, token_U, dest_U, local)
        )
        # Comm point: the rows, their routing weights and local expert indices, in one exchange.
        x_UD = token_rows(x_TD, token_U, self.ep_size)
        x_MD, *received = exchange_rows(x_UD, choices, fp8, output_splits, input_splits, self.ep_group, self.runtime)
        weights_MK, local_MK = unpack_choices(tuple(received), top_k)
        # Postprocess (no comm): one row per (received row, local expert), grouped by local expert, or on CPU by
        # source rank then local expert (the segments the plain path gives: the same rows in the same order).
        counts = [sum(row[e] for row in recv_SC) for e in range(local)]
        num_rows = sum(counts)
        if self._segments(x_MD):
            source_M = torch.repeat_interleave(
                torch.arange(self.ep_size, device=x_MD.device),
                torch.tensor(output_splits, device=x_MD.device),
                output_size=x_MD.shape[0],
            )
            here_MK = (local_MK >= 0) & (local_MK < local)
            key_MK = torch.where(here_MK, source_M.unsqueeze(-1) * local + local_MK, self.ep_size * local)
            assign_R = sort_by_expert(key_MK, self.ep_size * local)[0][:num_rows]
            splits = self._receive_segments(recv_SC)
        else:
            assign_R = sort_by_expert(local_MK, local)[0][:num_rows]
            splits = RowSplits.of(counts)
        handle = DedupHandle(
            token_U=token_U,
            assign_R=assign_R,
            weights_MK=weights_MK,
            num_tokens=num_tokens,
            out_dtype=x_TD.dtype,
            input_splits=input_splits,
            output_splits=output_splits,
        )
        return expand_rows(x_MD, assign_R, top_k), splits, handle

    def _dispatch_preprocess(self, indices_TK: Tensor) -> tuple[Tensor, Tensor]:
        """No comm: order the assignments by global expert (so by destination rank, then local expert)."""
        return sort_by_expert(indices_TK, self.num_experts)

    def _exchange_counts(self, counts_E: Tensor) -> tuple[list[int], list[list[int]], Tensor]:
        """Comm point: tell every rank how many rows of each of its experts it will receive from here.

        Returns the send counts and the receive counts ``[source][local expert]`` on the host (read once, after
        the exchange's wait), and the receive counts on the device ``[G, e]`` (for the regrouping).
        """
        recv_GE = exchange_counts(counts_E.view(self.ep_size, self.num_local_experts), self.ep_group, self.runtime)
        # NOTE: D2H sync (the all-to-all's splits), after the count exchange's hand-over and wait
        sizes = host_ints(torch.cat([counts_E, recv_GE.reshape(-1)]), self.runtime)
        send_E = sizes[: self.num_experts]
        flat_recv = sizes[self.num_experts :]
        local = self.num_local_experts
        recv_SE = [flat_recv[s * local : (s + 1) * local] for s in range(self.ep_size)]
        return send_E, recv_SE, recv_GE

    def _token_dispatch(self, x_AD: Tensor, input_splits: tuple[int, ...], output_splits: tuple[int, ...]) -> Tensor:
        """Comm point: the uneven all-to-all of the token rows."""
        return all_to_all(x_AD, output_splits, input_splits, self.ep_group, self.runtime)

    def _dispatch_postprocess(self, x_MD: Tensor, recv_GE: Tensor) -> tuple[Tensor, Tensor | None]:
        """No comm: regroup the received rows from (source, local expert) to (local expert, source)."""
        if self.ep_size == 1:
            return x_MD, None
        perm_R = chunk_permutation(recv_GE, x_MD.shape[0])
        return permute_rows(x_MD, perm_R), perm_R

    # -- combine -----------------------------------------------------------------------------------------------
    def combine(self, y_RD: Tensor, handle: AllToAllHandle | DedupHandle | StaticHandle) -> Tensor:
        """Send expert outputs back and sum them per token with the routing weights: ``out_TD``."""
        if isinstance(handle, StaticHandle):
            return self._combine_static(y_RD, handle)
        if isinstance(handle, DedupHandle):
            return self._combine_dedup(y_RD, handle)
        y_MD = self._combine_preprocess(y_RD, handle)
        y_AD = self._token_combine(y_MD, handle)
        return self._combine_postprocess(y_AD, handle)

    def _combine_preprocess(self, y_RD: Tensor, handle: AllToAllHandle) -> Tensor:
        """No comm: back to the receive layout (source-major)."""
        if handle.perm_R is None:
            return y_RD
        return permute_rows(y_RD, inverse_permutation(handle.perm_R), handle.perm_R)

    def _token_combine(self, y_MD: Tensor, handle: AllToAllHandle) -> Tensor:
        """Comm point: the reverse all-to-all."""
        return all_to_all(y_MD, handle.input_splits, handle.output_splits, self.ep_group, self.runtime)

    def _combine_postprocess(self, y_AD: Tensor, handle: AllToAllHandle) -> Tensor:
        """No comm: weight each row by its routing weight and sum it into its token (the unpermute)."""
        return scatter_weighted(y_AD, handle.assign_A, handle.weights_TK, handle.num_tokens, handle.out_dtype,
                                handle.token_A)  # fmt: skip

    def _combine_static(self, y_RD: Tensor, handle: StaticHandle) -> Tensor:
        """Static combine: back to the slots, the equal-split all-to-all back, each assignment's row read from its
        slot, weighted and summed into its token (the plain combine's order)."""
        y_MD = permute_rows(y_RD, inverse_permutation(handle.perm_R), handle.perm_R)
        splits_G = [handle.rows_per_rank] * self.ep_size
        y_SD = all_to_all(y_MD, splits_G, splits_G, self.ep_group, self.runtime)
        y_AD = read_slots(y_SD, handle.plan)
        return scatter_weighted(y_AD, handle.plan.order_A, handle.weights_TK, handle.num_tokens, handle.out_dtype)

    def _combine_dedup(self, y_RD: Tensor, handle: DedupHandle) -> Tensor:
        """Deduplicated combine: weight and sum per received row here, send one row per (token, rank) back."""
        num_rows = handle.weights_MK.shape[0]
        partial_MD = scatter_weighted(y_RD, handle.assign_R, handle.weights_MK, num_rows, handle.out_dtype)
        y_UD = all_to_all(partial_MD, handle.input_splits, handle.output_splits, self.ep_group, self.runtime)
        return sum_per_token(y_UD, handle.token_U, handle.num_tokens, self.ep_size)

