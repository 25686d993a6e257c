"""The block math of the fused linear cross-entropy: one ``[tokens, vocabulary rows]`` block of logits at a time.

Every function here works on the rows of the head this process holds (all of them, or one rank's slice of a
vocabulary-parallel head, ``vocab_start`` being the global index of its first row). Two dtypes (:class:`Blocks`):

- the GEMMs run in the inputs' dtype (``gemm_dtype``): bf16 / fp16 inputs take bf16 / fp16 GEMMs (tensor cores on a
  GPU; their products are accumulated in float32 inside the kernel and rounded once to the input dtype), as the
  unfused ``F.linear(h, w).float()`` and Liger's / Megatron's fused losses do; float32 and float64 inputs, and
  mixed ones, multiply in the promoted dtype;
- the softmax math (max, exp, sums, ``softmax - onehot``) is float32 (``dtype``; float64 for float64 inputs): each
  block of logits is upcast once after its GEMM, and only per-token vectors outlive it.

In backward the float32 gradient block is cast to ``gemm_dtype`` for its two GEMMs, and their results are
accumulated in float32: hidden's gradient over the row blocks in one ``[T, D]`` float32 buffer, a row block's
weight gradient over the token blocks in a ``[v, D]`` float32 buffer written to the weight's dtype once complete
(no float32 copy of the whole weight's gradient). With float32 (float64) inputs every step is the one before this
split: bitwise the same results.

Shape legend: T tokens, D hidden, V vocabulary rows held here; t and v one block's tokens and rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Blocks:
    """How ``[T, V]`` is cut: token spans of ``token_chunk`` and row spans of ``vocab_chunk`` (the last ones short);
    each block's GEMMs run in ``gemm_dtype`` (the inputs' promoted dtype) and its softmax math in ``dtype`` (float32,
    or float64 for float64 inputs). ``gemm_dtype=None``: ``dtype``."""

    num_tokens: int
    num_rows: int
    token_chunk: int
    vocab_chunk: int
    dtype: torch.dtype = torch.float32
    gemm_dtype: torch.dtype | None = None

    @property
    def mm_dtype(self) -> torch.dtype:
        """The dtype the GEMMs run in."""
        return self.dtype if self.gemm_dtype is None else self.gemm_dtype

    def tokens(self) -> list[tuple[int, int]]:
        return _spans(self.num_tokens, self.token_chunk)

    def rows(self) -> list[tuple[int, int]]:
        return _spans(self.num_rows, self.vocab_chunk)


def _spans(n: int, size: int) -> list[tuple[int, int]]:
    return [(start, min(start + size, n)) for start in range(0, n, size)]


def block_logits(h_tD: Tensor, w_vD: Tensor, b_v: Tensor | None, blocks: Blocks) -> Tensor:
    """``h @ w.T (+ b)``: ``[t, v]`` in ``blocks.dtype``, the GEMM in ``blocks.mm_dtype`` (upcast once after it, and
    the bias added in ``blocks.dtype``; no copy where the two dtypes are the same)."""
    mm = blocks.mm_dtype
    z_tv = (h_tD.to(mm) @ w_vD.to(mm).T).to(blocks.dtype)
    if b_v is not None:
        z_tv += b_v.to(blocks.dtype)
    return z_tv


@dataclass
class SoftmaxStats:
    """Per token, over the rows seen so far: the running max, the sum of ``exp(logit - max)`` and the target's
    logit (0 where the target is not among them). All ``[T]``, in the blocks' dtype."""

    max_T: Tensor
    sumexp_T: Tensor
    target_logit_T: Tensor

    @classmethod
    def empty(cls, num_tokens: int, dtype: torch.dtype, device: torch.device) -> SoftmaxStats:
        zeros = torch.zeros(num_tokens, dtype=dtype, device=device)
        return cls(torch.full_like(zeros, float("-inf")), zeros, zeros.clone())


def softmax_stats(
    h_TD: Tensor, w_VD: Tensor, b_V: Tensor | None, local_T: Tensor, blocks: Blocks
) -> SoftmaxStats:
    """The online softmax over the held rows, block by block; ``local_T``: each target's row here (out of
    ``[0, V)`` when another rank holds it, or the token is ignored)."""
    stats = SoftmaxStats.empty(blocks.num_tokens, blocks.dtype, h_TD.device)
    for v0, v1 in blocks.rows():
        w_vD, b_v = w_VD[v0:v1], None if b_V is None else b_V[v0:v1]
        for t0, t1 in blocks.tokens():
            z_tv = block_logits(h_TD[t0:t1], w_vD, b_v, blocks)
            hit_t, col_t = _targets_in(local_T[t0:t1], v0, v1)
            picked_t = z_tv.gather(1, col_t[:, None]).squeeze(1)
            stats.target_logit_T[t0:t1] += torch.where(hit_t, picked_t, 0.0)
            old_t = stats.max_T[t0:t1]
            new_t = torch.maximum(old_t, z_tv.amax(dim=1))
            rescaled_t = stats.sumexp_T[t0:t1] * torch.exp(old_t - new_t)
            stats.sumexp_T[t0:t1] = rescaled_t + z_tv.sub_(new_t[:, None]).exp_().sum(dim=1)  # in place: one block
            stats.max_T[t0:t1] = new_t
    return stats


def _targets_in(local_t: Tensor, v0: int, v1: int) -> tuple[Tensor, Tensor]:
    """Which tokens' targets are rows ``[v0, v1)``, and their column in the block (clamped where not)."""
    hit_t = (local_t >= v0) & (local_t < v1)
    return hit_t, (local_t - v0).clamp(0, v1 - v0 - 1)


@dataclass
class BlockGrads:
    """The gradients of the loss with respect to hidden (``[T, D]``, in the blocks' dtype), the held rows (in the
    weight's dtype, each row block accumulated in the blocks' dtype first) and their bias (in the blocks' dtype)."""

    hidden_TD: Tensor | None
    weight_VD: Tensor | None
    bias_V: Tensor | None


def block_grads(
    h_TD: Tensor, w_VD: Tensor, b_V: Tensor | None, local_T: Tensor, lse_T: Tensor, scale_T: Tensor,
    blocks: Blocks, needs: tuple[bool, bool, bool],
) -> BlockGrads:
    """``dloss/dlogits = scale * (softmax - onehot(target))`` block by block (the logits recomputed), in float32,
    then cast to the GEMM dtype and contracted with ``w`` (for hidden) and ``h`` (for the rows), the products summed
    over the blocks in float32; ``needs``: which of hidden, weight, bias want a gradient. Rows are the outer loop, so
    each row block's gradient is complete before the next starts."""
    need_h, need_w, need_b = needs
    dtype, mm = blocks.dtype, blocks.mm_dtype
    grad_h = torch.zeros(h_TD.shape, dtype=dtype, device=h_TD.device) if need_h else None
    grad_w = torch.empty(w_VD.shape, dtype=w_VD.dtype, device=w_VD.device) if need_w else None
    grad_b = torch.empty(w_VD.shape[0], dtype=dtype, device=w_VD.device) if need_b else None
    for v0, v1 in blocks.rows():
        w_vD, b_v = w_VD[v0:v1], None if b_V is None else b_V[v0:v1]
        wc_vD = w_vD.to(mm)
        acc_w_vD = torch.zeros((v1 - v0, w_VD.shape[1]), dtype=dtype, device=w_VD.device) if need_w else None
        if grad_b is not None:
            grad_b[v0:v1] = 0.0
        for t0, t1 in blocks.tokens():
            h_tD = h_TD[t0:t1]
            dz_tv = block_logits(h_tD, w_vD, b_v, blocks).sub_(lse_T[t0:t1, None]).exp_()  # softmax, in place
            hit_t, col_t = _targets_in(local_T[t0:t1], v0, v1)
            dz_tv.scatter_add_(1, col_t[:, None], -hit_t.to(dtype)[:, None])
            dz_tv.mul_(scale_T[t0:t1, None])
            if grad_b is not None:
                grad_b[v0:v1] += dz_tv.sum(dim=0)
            dzc_tv = dz_tv.to(mm)  # the float32 gradient block in the GEMMs' dtype (no copy where they agree)
            if grad_h is not None:
                grad_h[t0:t1] += dzc_tv @ wc_vD  # a bf16 GEMM's result widened exactly into the float32 sum
            if acc_w_vD is not None:
                acc_w_vD += dzc_tv.T @ h_tD.to(mm)
        if grad_w is not None:
            grad_w[v0:v1] = acc_w_vD  # complete: one rounding to the weight's dtype
    return BlockGrads(grad_h, grad_w, grad_b)
