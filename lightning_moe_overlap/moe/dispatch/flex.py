"""Flex token dispatcher on DeepEP: fused, deduplicated all-to-all kernels over NVLink and RDMA.

DeepEP sends each token once per destination rank (not once per (token, choice) pair) together with its top-k
indices and weights; the receiver gets the indices already translated to its local experts (``-1`` elsewhere).
Hence the routing weights are applied on the expert side, before the combine sums the per-rank partial outputs
back into each token.

Per call: ``Buffer.get_dispatch_layout`` (local), then ``Buffer.dispatch`` with ``async_finish=True`` at a comm
point (issue, ``runtime.handoff()``, then wait on the returned event); combine is one ``Buffer.combine`` at a comm
point. Backward: the dispatch's backward is a combine with the same DeepEP handle and the combine's backward a
cached-layout dispatch, both at comm points.

Host syncs: DeepEP itself waits for the receive counts (``num_recv_tokens_per_expert_list``) on the CPU.

``deep_ep`` is imported lazily; :func:`require_flex_backend` explains what is missing. DeepEP's kernels need a
CUDA device (Hopper, NVLink / RDMA) and take bfloat16 activations.

Shape legend:
    T: tokens on this rank   K: top-k   D: hidden size   N: tokens received (each once)   e: local experts
    R: (received token, choice) rows for local experts, sorted by local expert
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_moe_overlap._install import install_hint
from lightning_moe_overlap.moe.dispatch.base import DispatcherBase
from lightning_moe_overlap.moe.dispatch.comm import handoff, wait
from lightning_moe_overlap.moe.permute import gather_rows, scatter_weighted, sort_by_expert
from lightning_moe_overlap.overlap.runtime import CommRuntime

INSTALL_HINT = install_hint("deepep")


def require_flex_backend() -> Any:
    """Import and return ``deep_ep``, or raise ``ImportError`` naming what is missing and how to get it."""
    try:
        deep_ep = importlib.import_module("deep_ep")
    except ImportError as err:
        raise ImportError(
            "dispatcher='flex' needs the DeepEP package (`deep_ep`), which is not installed. Install it with "
            f"{INSTALL_HINT} on a CUDA machine (Hopper GPUs with NVLink/RDMA), or use dispatcher='alltoall'."
        ) from err
    if not torch.cuda.is_available():
        raise ImportError(
            "dispatcher='flex' needs CUDA: DeepEP's kernels run on Hopper GPUs over NVLink/RDMA, but no CUDA device "
            "is available. Run on such a machine, or use dispatcher='alltoall' (runs everywhere, gloo included)."
        )
    return deep_ep


def _make_buffer(group: ProcessGroup, hidden_bytes: int, num_sms: int) -> Any:
    """A ``deep_ep.Buffer`` sized for ``hidden_bytes`` per token, as DeepEP's own examples size it."""
    deep_ep = require_flex_backend()
    buffer_cls = deep_ep.Buffer
    buffer_cls.set_num_sms(num_sms)
    size = group.size()
    nvl_bytes = rdma_bytes = 0
    for config in (buffer_cls.get_dispatch_config(size), buffer_cls.get_combine_config(size)):
        nvl_bytes = max(nvl_bytes, config.get_nvl_buffer_size_hint(hidden_bytes, size))
        rdma_bytes = max(rdma_bytes, config.get_rdma_buffer_size_hint(hidden_bytes, size))
    return buffer_cls(group, nvl_bytes, rdma_bytes)


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
        out_dtype: dtype of the combined output.
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
            left runs the overlapped compute.
        deepep_buffer: an object with DeepEP's ``Buffer`` methods to use instead of building one (a buffer shared
            with other code, or a test double). Without it, ``deep_ep`` and CUDA are required.
    """

    name = "flex"

    def __init__(
        self,
        ep_group: ProcessGroup | None,
        num_experts: int,
        runtime: CommRuntime | None,
        *,
        deepep_num_sms: int = 20,
        deepep_buffer: Any = None,
    ) -> None:
        if (
            isinstance(deepep_num_sms, bool)
            or not isinstance(deepep_num_sms, int)
            or deepep_num_sms < 2
            or deepep_num_sms % 2
        ):
            raise ValueError(
                f"`FlexDispatcher`: deepep_num_sms={deepep_num_sms!r} must be a positive even integer (DeepEP "
                "splits its SMs into send/receive pairs); 20-24 is usual on H100/H200."
            )
        if deepep_buffer is None:
            require_flex_backend()
            if ep_group is None:
                raise ValueError(
                    "`FlexDispatcher`: ep_group=None; DeepEP builds its buffer on a process group. Pass the "
                    "expert-parallel group (ParallelGroups.ep)."
                )
        super().__init__(ep_group, num_experts, runtime)
        self.num_sms = deepep_num_sms
        self._buffer = deepep_buffer
        self._buffer_hidden_bytes = 0

    def _get_buffer(self, x_TD: Tensor) -> Any:
        """The DeepEP buffer, (re)built when a wider hidden size needs more room. Shared by all calls."""
        hidden_bytes = x_TD.shape[-1] * max(x_TD.element_size(), 2)
        if self._buffer is None or (self._buffer_hidden_bytes and hidden_bytes > self._buffer_hidden_bytes):
            assert self.ep_group is not None  # checked in __init__
            self._buffer = _make_buffer(self.ep_group, hidden_bytes, self.num_sms)
            self._buffer_hidden_bytes = hidden_bytes
        return self._buffer

    # -- dispatch ----------------------------------------------------------------------------------------------
    def dispatch(self, x_TD: Tensor, indices_TK: Tensor, weights_TK: Tensor) -> tuple[Tensor, list[int], FlexHandle]:
        """DeepEP dispatch, then expand to one row per (received token, local expert) pair."""
        topk_idx_TK, weights_TK = self._dispatch_preprocess(indices_TK, weights_TK)
        buffer = self._get_buffer(x_TD)
        recv_x_ND, recv_w_NK, recv_idx_NK, deep_handle, counts = self._token_dispatch(
            x_TD, weights_TK, topk_idx_TK, buffer
        )
        x_RD, assign_R = self._dispatch_postprocess(recv_x_ND, recv_idx_NK, counts)
        handle = FlexHandle(
            deep_handle=deep_handle,
            buffer=buffer,
            assign_R=assign_R,
            recv_weights_NK=recv_w_NK,
            num_recv=recv_x_ND.shape[0],
            out_dtype=x_TD.dtype,
        )
        return x_RD, counts, handle

    def _dispatch_preprocess(self, indices_TK: Tensor, weights_TK: Tensor) -> tuple[Tensor, Tensor]:
        """No comm: DeepEP's conventions, int64 indices with ``-1`` for dropped choices and float32 weights."""
        idx = indices_TK.long()
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
        return _FlexCombine.apply(y_ND, handle.buffer, handle.deep_handle, self.runtime, torch.is_grad_enabled())

    def _combine_postprocess(self, out_TD: Tensor, handle: FlexHandle) -> Tensor:
        """No comm: DeepEP returns the activations' dtype already; make sure of it."""
        return out_TD.to(handle.out_dtype)
