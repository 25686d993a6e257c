"""Flex token dispatcher on DeepEP: fused, deduplicated all-to-all kernels over NVLink and RDMA.

DeepEP sends each token once per destination rank (not once per (token, choice) pair) together with its top-k
indices and weights; the receiver gets the indices already translated to its local experts (``-1`` elsewhere).
Hence the routing weights are applied on the expert side, before the combine sums the per-rank partial outputs
back into each token.

Per call: ``Buffer.get_dispatch_layout`` (local), then ``Buffer.dispatch`` with ``async_finish=True`` at a comm
point (issue, ``runtime.handoff()``, then wait on the returned event); combine is one ``Buffer.combine`` at a comm
point. Backward: the dispatch's backward is a combine with the same DeepEP handle and the combine's backward a
cached-layout dispatch, both at comm points.

Dtypes: DeepEP's normal kernels move bfloat16 activations only. The tokens are cast to the buffers'
``wire_dtype`` (bfloat16) before the dispatch and back to the caller's dtype right after it (before the rows are
expanded per expert), and the summed expert outputs are cast to it before the combine and back after it. The
casts are autograd ops, so both backward exchanges see bfloat16 gradients too. Routing weights travel in
float32, as DeepEP takes them.

Buffers: one per process (:class:`~lightning_moe_overlap.moe.dispatch.deepep_buffers.DeepEPBuffers`), shared
by the flex dispatchers of all layers, never one per layer.

Host syncs: none of our own. Inside ``Buffer.dispatch`` (before the hand-over) DeepEP waits on the CPU for the
receive counts of its notify kernel, a poll of host-mapped memory, to size the receive tensors; the token
transfer is still in flight at the hand-over. The backward's cached dispatch and both combines do not wait.

``deep_ep`` is imported lazily; :func:`require_flex_backend` explains what is missing. DeepEP's kernels need a
CUDA device (Hopper, NVLink / RDMA) and 2, 4 or 8 ranks in a node, or a multiple of 8 across nodes
(``docs/validation.md``, rule ``flex-ep-size``).

Shape legend:
    T: tokens on this rank   K: top-k   D: hidden size   N: tokens received (each once)   e: local experts
    R: (received token, choice) rows for local experts, sorted by local expert
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_moe_overlap.moe.dispatch.base import DispatcherBase
from lightning_moe_overlap.moe.dispatch.comm import handoff, wait
from lightning_moe_overlap.moe.dispatch.deepep_buffers import (
    INSTALL_HINT,
    DeepEPBuffers,
    index_dtype,
    require_flex_backend,
)
from lightning_moe_overlap.moe.grouped import RowSplits
from lightning_moe_overlap.moe.permute import gather_rows, scatter_weighted, sort_by_expert
from lightning_moe_overlap.overlap.runtime import CommRuntime

__all__ = ["INSTALL_HINT", "FlexDispatcher", "FlexHandle", "require_flex_backend"]


class _EventWork:
    """A DeepEP event as a waitable collective: waiting makes the compute stream wait for the comm kernel."""

    __slots__ = ("event",)

    def __init__(self, event: Any) -> None:
        self.event = event

    def wait(self) -> None:
        self.event.current_stream_wait()


def _comm_point(event: Any, runtime: CommRuntime | None, grad_enabled: bool | None = None) -> None:
    """The kernel was issued with ``async_finish=True``: hand over, then make the compute stream wait for it."""
    handoff(runtime, grad_enabled)
    wait(runtime, _EventWork(event))


class _FlexDispatch(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        x_TD: Tensor,
        weights_TK: Tensor,
        topk_idx_TK: Tensor,
        buffer: Any,
        num_experts: int,
        runtime: CommRuntime | None,
        grad_enabled: bool,
    ) -> tuple[Tensor, Tensor, Tensor, Any, list[int]]:
        per_rank, per_rdma_rank, per_expert, in_rank, layout_event = buffer.get_dispatch_layout(
            topk_idx_TK, num_experts, previous_event=buffer.capture(), async_finish=True, allocate_on_comm_stream=True
        )
        recv_x, recv_idx, recv_w, recv_counts, deep_handle, event = buffer.dispatch(
            x_TD,
            topk_idx=topk_idx_TK,
            topk_weights=weights_TK,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            previous_event=layout_event,
            async_finish=True,
            allocate_on_comm_stream=True,
        )
        _comm_point(event, runtime, grad_enabled)
        ctx.buffer, ctx.deep_handle, ctx.runtime = buffer, deep_handle, runtime
        ctx.recv_x_meta = (recv_x.shape, recv_x.dtype, recv_x.device)
        ctx.recv_w_shape = recv_w.shape
        ctx.mark_non_differentiable(recv_idx)
        # NOTE: D2H sync inside DeepEP: `recv_counts` is a host list of rows per local expert.
        return recv_x, recv_w, recv_idx, deep_handle, list(recv_counts)

    @staticmethod
    def backward(ctx, g_x: Tensor, g_w: Tensor | None, *_: Any) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        # The backward of a dispatch is a combine over the same layout: gradients flow back to the source tokens.
        shape, dtype, device = ctx.recv_x_meta
        g_x = torch.zeros(shape, dtype=dtype, device=device) if g_x is None else g_x
        g_w = torch.zeros(ctx.recv_w_shape, dtype=torch.float32, device=device) if g_w is None else g_w
        grad_x, grad_w, event = ctx.buffer.combine(
            g_x.contiguous(),
            ctx.deep_handle,
            topk_weights=g_w.float().contiguous(),
            previous_event=ctx.buffer.capture(),
            async_finish=True,
            allocate_on_comm_stream=True,
        )
        _comm_point(event, ctx.runtime)
        return grad_x, (grad_w if ctx.needs_input_grad[1] else None), None, None, None, None, None


class _FlexCombine(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, y_ND: Tensor, buffer: Any, deep_handle: Any, runtime: CommRuntime | None, grad_enabled: bool
    ) -> Tensor:
        out_TD, _, event = buffer.combine(
            y_ND.contiguous(),
            deep_handle,
            previous_event=buffer.capture(),
            async_finish=True,
            allocate_on_comm_stream=True,
        )
        _comm_point(event, runtime, grad_enabled)
        ctx.buffer, ctx.deep_handle, ctx.runtime = buffer, deep_handle, runtime
        return out_TD

    @staticmethod
    def backward(ctx, g_TD: Tensor) -> tuple[Tensor, None, None, None, None]:  # type: ignore[override]
        # The backward of a combine is a dispatch with the cached layout of the forward dispatch.
        grad_ND, *_, event = ctx.buffer.dispatch(
            g_TD.contiguous(),
            handle=ctx.deep_handle,
            previous_event=ctx.buffer.capture(),
            async_finish=True,
            allocate_on_comm_stream=True,
        )
        _comm_point(event, ctx.runtime)
        return grad_ND, None, None, None, None


@dataclass(frozen=True)
class FlexHandle:
    """Per-call state from :meth:`FlexDispatcher.dispatch` to :meth:`FlexDispatcher.combine`.

    Attributes:
        deep_handle: DeepEP's layout handle (reused by combine and by both backwards).
        buffer: the DeepEP buffer the dispatch ran on.
        assign_R: flat (received token, choice) ids of the rows, in row order.
        recv_weights_NK: routing weights of the received tokens (applied here, on the expert side).
        num_recv: ``N``.
        out_dtype: dtype of the combined output (the caller's dtype of the tokens).
    """

    deep_handle: Any
    buffer: Any
    assign_R: Tensor
    recv_weights_NK: Tensor
    num_recv: int
    out_dtype: torch.dtype


class FlexDispatcher(DispatcherBase):
    """DeepEP-backed dispatcher (``dispatcher="flex"``, ``flex_backend="deepep"``).

    Args:
        ep_group: the expert-parallel group (DeepEP builds its buffer on it).
        num_experts: global number of experts.
        runtime: comm-point hand-over target.
        deepep_num_sms: streaming multiprocessors DeepEP's kernels may use (``Buffer.set_num_sms``); what is
            left runs the overlapped compute. Used (and checked) when this dispatcher makes its own
            ``DeepEPBuffers``.
        deepep_buffers: the process's :class:`DeepEPBuffers`, shared by the flex dispatchers of every layer
            (``apply_expert_parallel`` makes one per model). Without it (and without ``deepep_buffer``) this
            dispatcher makes its own, which then serves this layer only.
        deepep_buffer: an object with DeepEP's ``Buffer`` methods to use as is (a test double, or a buffer of
            other code): never rebuilt, and the activations travel in the caller's dtype. Exclusive with
            ``deepep_buffers``. Without either, ``deep_ep`` and CUDA are required.
    """

    name = "flex"
    knobs = ("deepep_num_sms", "deepep_buffers", "deepep_buffer")

    def __init__(
        self,
        ep_group: ProcessGroup | None,
        num_experts: int,
        runtime: CommRuntime | None,
        *,
        deepep_num_sms: int = 20,
        deepep_buffers: DeepEPBuffers | None = None,
        deepep_buffer: Any = None,
    ) -> None:
        if deepep_buffers is not None and deepep_buffer is not None:
            raise ValueError(
                "`FlexDispatcher`: got both deepep_buffers and deepep_buffer; they are two ways to say where the "
                "DeepEP buffer comes from. Pass deepep_buffers (shared, sized and cast for DeepEP) or deepep_buffer "
                "(one object used as is), not both."
            )
        if deepep_buffers is None:
            deepep_buffers = (
                DeepEPBuffers(deepep_num_sms)
                if deepep_buffer is None
                else DeepEPBuffers(deepep_num_sms, wire_dtype=None, buffer_factory=lambda group, nbytes: deepep_buffer)
            )
        self._index_dtype = torch.int64  # a stand-in buffer's; DeepEP's own build says (`topk_idx_t`)
        if deepep_buffers.builds_deepep:
            self._index_dtype = index_dtype(require_flex_backend())
            if ep_group is None:
                raise ValueError(
                    "`FlexDispatcher`: ep_group=None; DeepEP builds its buffer on a process group. Pass the "
                    "expert-parallel group (ParallelGroups.ep)."
                )
        super().__init__(ep_group, num_experts, runtime)
        self.num_sms = deepep_buffers.num_sms
        self.buffers = deepep_buffers

    def _get_buffer(self, x_TD: Tensor) -> Any:
        """The process's DeepEP buffer for this group, big enough for a row of ``x_TD`` on the wire."""
        return self.buffers.get(self.ep_group, self.buffers.row_bytes(x_TD.shape[-1], x_TD.dtype))

    def _to_wire(self, x: Tensor) -> Tensor:
        """The dtype DeepEP's kernels take (autograd op: the gradient comes back in the caller's dtype)."""
        wire = self.buffers.wire_dtype
        return x if wire is None else x.to(wire)

    # -- dispatch ----------------------------------------------------------------------------------------------
    def dispatch(self, x_TD: Tensor, indices_TK: Tensor, weights_TK: Tensor) -> tuple[Tensor, RowSplits, FlexHandle]:
        """DeepEP dispatch, then expand to one row per (received token, local expert) pair: ``(x_RD, splits,
        handle)``, rows sorted by local expert."""
        topk_idx_TK, weights_TK = self._dispatch_preprocess(indices_TK, weights_TK)
        buffer = self._get_buffer(x_TD)
        recv_x_ND, recv_w_NK, recv_idx_NK, deep_handle, counts = self._token_dispatch(
            self._to_wire(x_TD), weights_TK, topk_idx_TK, buffer
        )
        x_RD, assign_R = self._dispatch_postprocess(recv_x_ND.to(x_TD.dtype), recv_idx_NK, counts)
        handle = FlexHandle(
            deep_handle=deep_handle,
            buffer=buffer,
            assign_R=assign_R,
            recv_weights_NK=recv_w_NK,
            num_recv=recv_x_ND.shape[0],
            out_dtype=x_TD.dtype,
        )
        return x_RD, RowSplits.of(counts), handle

    def _dispatch_preprocess(self, indices_TK: Tensor, weights_TK: Tensor) -> tuple[Tensor, Tensor]:
        """No comm: DeepEP's conventions, indices of its build's dtype (``topk_idx_t``) with ``-1`` for dropped
        choices, and float32 weights."""
        idx = indices_TK.to(self._index_dtype)
        dropped = (idx < 0) | (idx >= self.num_experts)
        return torch.where(dropped, torch.full_like(idx, -1), idx), weights_TK.float()

    def _token_dispatch(
        self, x_TD: Tensor, weights_TK: Tensor, topk_idx_TK: Tensor, buffer: Any
    ) -> tuple[Tensor, Tensor, Tensor, Any, list[int]]:
        """Comm point: DeepEP's dispatch (layout, then the fused all-to-all)."""
        return _FlexDispatch.apply(
            x_TD, weights_TK, topk_idx_TK, buffer, self.num_experts, self.runtime, torch.is_grad_enabled()
        )

    def _dispatch_postprocess(self, recv_x_ND: Tensor, recv_idx_NK: Tensor, counts: list[int]) -> tuple[Tensor, Tensor]:
        """No comm: one row per (received token, local expert), sorted by local expert."""
        order, _ = sort_by_expert(recv_idx_NK, self.num_local_experts)
        assign_R = order[: sum(counts)]
        return gather_rows(recv_x_ND, assign_R, recv_idx_NK.shape[-1]), assign_R

    # -- combine -----------------------------------------------------------------------------------------------
    def combine(self, y_RD: Tensor, handle: FlexHandle) -> Tensor:
        """Weight the rows, sum them per received token, and DeepEP-combine back to the source ranks."""
        y_ND = self._combine_preprocess(y_RD, handle)
        out_TD = self._token_combine(y_ND, handle)
        return self._combine_postprocess(out_TD, handle)

    def _combine_preprocess(self, y_RD: Tensor, handle: FlexHandle) -> Tensor:
        """No comm: expert-side weighting and per-token sum (the unpermute)."""
        return scatter_weighted(y_RD, handle.assign_R, handle.recv_weights_NK, handle.num_recv, handle.out_dtype)

    def _token_combine(self, y_ND: Tensor, handle: FlexHandle) -> Tensor:
        """Comm point: DeepEP's combine (sums the partial outputs of every rank into each source token)."""
        return _FlexCombine.apply(
            self._to_wire(y_ND), handle.buffer, handle.deep_handle, self.runtime, torch.is_grad_enabled()
        )

    def _combine_postprocess(self, out_TD: Tensor, handle: FlexHandle) -> Tensor:
        """No comm: back from the wire dtype to the caller's."""
        return out_TD.to(handle.out_dtype)
