"""Fused linear cross-entropy: the LM head's projection and the loss in one autograd function, block by block, so
the ``[tokens, vocabulary]`` logits never exist (Megatron / LoongForge's ``--cross-entropy-loss-fusion
--cross-entropy-fusion-impl linear``; docs/memory.md, "Fused linear cross-entropy").

Forward: an online softmax over ``[chunk, chunk]`` blocks of logits (``blocks.py``) keeps three float32 numbers per
token (running max, sum of exponentials, target logit; float64 for float64 inputs); with a vocabulary-parallel head
(``group``) they are combined over the group by two all-reduces. Backward recomputes each block from the saved
inputs and the per-token log-sum-exp; nothing of size ``[T, V]`` is kept in between. At most a few
``[chunk, chunk]`` float32 blocks are alive at once.

Precision: the GEMMs run in the inputs' dtype (bf16 inputs: bf16 GEMMs, accumulated in float32 inside the kernel,
as the unfused ``F.linear(h, w).float()`` computes its logits), the softmax math of each block in float32; float32
and float64 inputs compute every step in their own dtype (``blocks.py``).

Shape legend: T tokens, D hidden, V vocabulary rows held by this process.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_moe_overlap.loss.blocks import Blocks, SoftmaxStats, block_grads, softmax_stats

Reduction = Literal["mean", "sum"]
DEFAULT_CHUNK_SIZE = 3072  # the seed's LCE_GENERIC_FWD_VOCAB_SPLIT_SIZE


def fused_linear_cross_entropy(
    hidden_TD: Tensor,
    weight_VD: Tensor,
    target_T: Tensor,
    *,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    token_chunk_size: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """``F.cross_entropy(hidden @ weight.T + bias, target)`` without the logits: a float32 scalar (float64 for
    float64 inputs).

    Args:
        hidden_TD: The head's input ``[..., D]`` (e.g. ``[B, S, D]``; flattened to ``[T, D]``).
        weight_VD: The head's weight ``[V, D]``: the whole vocabulary, or with ``group`` this rank's rows
            ``[r * V, (r + 1) * V)`` of a vocabulary of ``V * group_size`` rows (pad the vocabulary to a multiple).
        target_T: Target ids ``[...]`` (``hidden_TD``'s leading shape), global ids in ``[0, V * group_size)`` or
            ``ignore_index``; the same on every rank of ``group``. Not range-checked (that would read them on the
            host): an id out of range contributes as if its logit were 0.
        bias: The head's bias ``[V]`` (this rank's rows), or None.
        ignore_index: Targets that take no loss and get no gradient.
        reduction: ``"mean"`` over the tokens that are not ignored (NaN when there are none, as
            ``F.cross_entropy``), or ``"sum"``.
        chunk_size: Vocabulary rows per block (and tokens per block unless ``token_chunk_size``).
        token_chunk_size: Tokens per block; None: ``chunk_size``.
        group: The vocabulary-parallel group the head's rows are split over; None: the whole head is here.

    The gradient of ``hidden`` is the full one on every rank of ``group`` (summed over the rows of all ranks, as a
    column-parallel head's input gradient is); ``weight`` and ``bias`` get this rank's rows. Gradients come back in
    each input's dtype. With autocast off, the head's GEMMs run in the dtype of ``hidden`` and ``weight`` promoted
    together (bf16 inputs: bf16 GEMMs, their products accumulated in float32 by the kernel, each logit rounded to
    bf16 once as the unfused bf16 ``F.linear`` rounds it) and each block's softmax math in float32 (float64 for
    float64 inputs); the gradient blocks are cast to the GEMM dtype for the backward GEMMs, whose results are summed
    in float32.
    """
    check_fused_inputs(hidden_TD, weight_VD, target_T, bias, reduction, chunk_size, token_chunk_size)
    width = hidden_TD.shape[-1]
    gemm_dtype = torch.promote_types(hidden_TD.dtype, weight_VD.dtype)
    dtype = torch.promote_types(gemm_dtype, torch.float32)
    blocks = Blocks(
        target_T.numel(), weight_VD.shape[0], token_chunk_size or chunk_size, chunk_size, dtype, gemm_dtype
    )
    flat_TD, flat_T = hidden_TD.reshape(-1, width), target_T.reshape(-1).long()
    return _FusedLinearCrossEntropy.apply(flat_TD, weight_VD, bias, flat_T, blocks, ignore_index, reduction, group)


def refuse_tensor_parallel_head(weight: Tensor, where: str) -> None:
    """``NotImplementedError`` for a head made tensor-parallel by a plan (a ``DTensor`` over tp) passed here as it
    is: this function takes plain tensors (the rank's rows with ``group=``); ``head_cross_entropy`` splits it."""
    if isinstance(weight, DTensor):
        raise NotImplementedError(
            f"`{where}`: the LM head's weight is a DTensor {list(weight.shape)} with placements "
            f"{tuple(weight.placements)} (tensor parallelism, `tp > 1`). Rule: `fused_linear_cross_entropy` takes "
            "plain tensors: the head's whole weight, or this rank's rows with `group=` and the whole sequence's "
            "hidden states. Fix: call `lightning_moe_overlap.loss.vocab_parallel.head_cross_entropy`, which does "
            "that for a vocabulary-parallel head."
        )


def check_fused_inputs(
    hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, reduction: str, chunk_size: int,
    token_chunk_size: int | None,
) -> None:
    """``ValueError`` / ``TypeError`` naming the shapes or values that cannot go together."""
    where = "fused_linear_cross_entropy"
    refuse_tensor_parallel_head(weight, where)
    if reduction not in ("mean", "sum"):
        raise ValueError(f"`{where}`: reduction={reduction!r}. Rule: 'mean' or 'sum'. Fix: pass one of them.")
    for name, value in (("chunk_size", chunk_size), ("token_chunk_size", token_chunk_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"`{where}`: {name}={value!r}. Rule: an integer >= 1. Fix: e.g. {name}=3072.")
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"`{where}`: hidden {list(hidden.shape)} and weight {list(weight.shape)}. Rule: weight is [V, D] and "
            "hidden [..., D], the same D. Fix: pass the head's weight as nn.Linear holds it ([out, in])."
        )
    if target.shape != hidden.shape[:-1]:
        raise ValueError(
            f"`{where}`: target {list(target.shape)} for hidden {list(hidden.shape)}. Rule: one target per hidden "
            "vector (target's shape is hidden's without the last dimension). Fix: shift and reshape the targets "
            "as the hidden states are."
        )
    if target.dtype.is_floating_point or target.dtype == torch.bool:
        raise TypeError(
            f"`{where}`: target has dtype {target.dtype}. Rule: class ids, an integer tensor. Fix: pass "
            "target.long()."
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(
            f"`{where}`: bias {list(bias.shape)} for weight {list(weight.shape)}. Rule: one bias per weight row. "
            "Fix: pass the head's own bias (or None)."
        )


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, h_TD: Tensor, w_VD: Tensor, b_V: Tensor | None, target_T: Tensor, blocks: Blocks,
        ignore_index: int, reduction: Reduction, group: dist.ProcessGroup | None,
    ) -> Tensor:
        local_T = target_T - _vocab_start(w_VD.shape[0], group)
        with torch.autocast(h_TD.device.type, enabled=False):
            stats = softmax_stats(h_TD, w_VD, b_V, local_T, blocks)
        lse_T, target_logit_T = _combine(stats, group)
        valid_T = target_T != ignore_index
        loss_T = torch.where(valid_T, lse_T - target_logit_T, 0.0)
        divisor = valid_T.sum().to(lse_T.dtype) if reduction == "mean" else None
        ctx.save_for_backward(h_TD, w_VD, b_V, local_T, lse_T, valid_T, divisor)
        ctx.blocks, ctx.group = blocks, group
        return loss_T.sum() if divisor is None else loss_T.sum() / divisor

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        h_TD, w_VD, b_V, local_T, lse_T, valid_T, divisor = ctx.saved_tensors
        scale_T = valid_T.to(lse_T.dtype) * grad_loss.to(lse_T.dtype)
        if divisor is not None:
            scale_T = scale_T / divisor
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2])
        with torch.autocast(h_TD.device.type, enabled=False):
            grads = block_grads(h_TD, w_VD, b_V, local_T, lse_T, scale_T, ctx.blocks, needs)
        if grads.hidden_TD is not None and ctx.group is not None:
            dist.all_reduce(grads.hidden_TD, group=ctx.group)  # every rank's rows contribute to hidden's gradient
        return (
            _as(grads.hidden_TD, h_TD), _as(grads.weight_VD, w_VD), _as(grads.bias_V, b_V), None, None, None, None,
            None,
        )


def _as(grad: Tensor | None, like: Tensor | None) -> Tensor | None:
    return None if grad is None or like is None else grad.to(like.dtype)


def _vocab_start(rows: int, group: dist.ProcessGroup | None) -> int:
    """The global id of this rank's first row (0 without a group)."""
    return 0 if group is None else dist.get_rank(group) * rows


def _combine(stats: SoftmaxStats, group: dist.ProcessGroup | None) -> tuple[Tensor, Tensor]:
    """Per token: the log-sum-exp over the whole vocabulary and the target's logit (its owner's), combined over
    ``group``: the max first, then the rescaled sums and the target logits in one all-reduce."""
    if group is None:
        return stats.max_T + torch.log(stats.sumexp_T), stats.target_logit_T
    max_T = stats.max_T.clone()
    dist.all_reduce(max_T, op=dist.ReduceOp.MAX, group=group)
    sums_2T = torch.stack([stats.sumexp_T * torch.exp(stats.max_T - max_T), stats.target_logit_T])
    dist.all_reduce(sums_2T, group=group)
    return max_T + torch.log(sums_2T[0]), sums_2T[1]
