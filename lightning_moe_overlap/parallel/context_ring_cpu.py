"""Torch's ring attention for the CPU SDPA op: context parallelism that runs, and is tested, without a GPU.

Under context parallelism torch hands SDPA ops whose inputs are ``DTensor``s sharded on the sequence (``Shard(2)``)
to handlers that run a ring: each rank keeps its queries, the keys and values travel round the cp group, the op
runs once per block and the partial outputs are merged by their log-sum-exp (backward: the same ring, with the k/v
gradients travelling back to their owners). Torch has handlers for the CUDA ops (flash, efficient, cuDNN) only; on
CPU, SDPA dispatches ``aten._scaled_dot_product_flash_attention_for_cpu`` and torch raises "does not have a sharding
strategy registered". This module adds that op and its backward to torch's handler table and runs them through
torch's own ring loops (``ring_attention_forward`` / ``ring_attention_backward`` of ``_compat/torch.py``): the CPU
op returns ``(out, logsumexp)`` and its backward takes ``grad_out, query, key, value, out, logsumexp`` by the names
the loops pass, so nothing of the ring itself is written here, only the handler around it (torch's handler also
runs a sharding-rule lookup, which has no entry for the CPU op; this one checks the placements itself).

:func:`install_cpu_ring_attention` adds the two handlers, once, to the table that torch merges into ``DTensor``'s
dispatcher while context parallelism is on; it changes nothing while it is off, and nothing for the CUDA ops.
Shapes: ``B`` batch, ``H`` query heads, ``G`` key/value heads (``H`` for MHA, fewer for GQA), ``S`` this rank's
sequence shard, ``D`` head dim.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from lightning_moe_overlap._compat import torch as torch_compat

CPU_FORWARD, CPU_BACKWARD = torch_compat.cpu_sdpa_ops()
SEQ_DIM = 2  # (B, H, S, D): torch's ring loops hard-code it too


def install_cpu_ring_attention() -> bool:
    """Make torch's context-parallel SDPA run on CPU: add the CPU flash op and its backward to torch's
    context-parallel handler table. Idempotent; returns whether this call added them. Takes effect the next time
    torch's context-parallel dispatcher is enabled (``context_parallel``, or
    :class:`~lightning_moe_overlap.parallel.context_attention.ContextParallelAttention`)."""
    table = torch_compat.cp_handler_table()
    if table.get(CPU_FORWARD) is _forward_handler and table.get(CPU_BACKWARD) is _backward_handler:
        return False
    table[CPU_FORWARD] = _forward_handler
    table[CPU_BACKWARD] = _backward_handler
    return True


def cpu_ring_attention_installed() -> bool:
    """Whether :func:`install_cpu_ring_attention` has run in this process."""
    table = torch_compat.cp_handler_table()
    return table.get(CPU_FORWARD) is _forward_handler and table.get(CPU_BACKWARD) is _backward_handler


def _forward_handler(op: Any, args: tuple, kwargs: dict) -> tuple[DTensor, DTensor]:
    """``_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask, scale)`` on
    ``Shard(2)`` DTensors -> ``(out_BHSD, logsumexp_BHS)``, both ``Shard(2)``."""
    info = torch_compat.dtensor_op_info(op, args, kwargs)
    mesh = _sequence_mesh(op, info)
    q_BHSD, k_BGSD, v_BGSD, dropout_p, is_causal, attn_mask, scale = _forward_args(
        *info.local_args, **info.local_kwargs
    )
    _refuse_unsupported(dropout_p, attn_mask)
    out_BHSD, lse_BHS, *_ = torch_compat.ring_attention_forward(
        mesh.get_group(), CPU_FORWARD, q_BHSD, k_BGSD, v_BGSD, is_causal=is_causal, scale=scale
    )
    return _sharded(out_BHSD, mesh), _sharded(lse_BHS, mesh)


def _backward_handler(op: Any, args: tuple, kwargs: dict) -> tuple[DTensor, DTensor, DTensor]:
    """``_scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, logsumexp, dropout_p,
    is_causal, *, attn_mask, scale)`` on ``Shard(2)`` DTensors -> ``(grad_q, grad_k, grad_v)``, all ``Shard(2)``."""
    info = torch_compat.dtensor_op_info(op, args, kwargs)
    mesh = _sequence_mesh(op, info)
    grad_out, q, k, v, out, lse, dropout_p, is_causal, attn_mask, scale = _backward_args(
        *info.local_args, **info.local_kwargs
    )
    _refuse_unsupported(dropout_p, attn_mask)
    grad_q, grad_k, grad_v, *_ = torch_compat.ring_attention_backward(
        mesh.get_group(), CPU_BACKWARD, grad_out,
        query=q, key=k, value=v, out=out, logsumexp=lse, is_causal=is_causal, dropout_p=0.0, scale=scale,
    )  # fmt: skip
    return _sharded(grad_q, mesh), _sharded(grad_k, mesh), _sharded(grad_v, mesh)


def _forward_args(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
) -> tuple:
    return query, key, value, dropout_p, is_causal, attn_mask, scale


def _backward_args(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    logsumexp: Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
) -> tuple:
    return grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask, scale


def _sequence_mesh(op: Any, info: Any) -> Any:
    """The 1-D cp mesh every ``DTensor`` argument is sharded on along the sequence; else NotImplementedError."""
    placements = [tuple(spec.placements) for spec in info.flat_args_schema if hasattr(spec, "placements")]
    mesh = info.compute_mesh
    if mesh.ndim != 1 or any(p != (Shard(SEQ_DIM),) for p in placements):
        raise NotImplementedError(
            f"{op} under context parallelism got DTensors on a {mesh.ndim}-D mesh with placements {placements}; the "
            f"CPU ring attention takes query, key and value sharded on the sequence only ((Shard({SEQ_DIM}),) on the "
            "1-D cp mesh). Pass plain local (batch, heads, seq, dim) shards to scaled_dot_product_attention inside "
            "context parallelism, or take the heads' tensor-parallel DTensors to local tensors first."
        )
    return mesh


def _refuse_unsupported(dropout_p: float, attn_mask: Tensor | None) -> None:
    if attn_mask is not None:
        raise NotImplementedError(
            "scaled_dot_product_attention got an attn_mask under context parallelism; the ring attention takes no "
            "mask (torch's CUDA ring refuses attn_bias the same way). Use is_causal=True without a mask (drop the "
            "padding mask: pack or pad sequences to the full length), or run with cp=1."
        )
    if dropout_p != 0.0:
        raise NotImplementedError(
            f"scaled_dot_product_attention got dropout_p={dropout_p} under context parallelism on CPU; the CPU op "
            "keeps no random state, so its backward cannot replay each ring block's dropout. Set the attention "
            "dropout to 0.0 (as training large models does), or run with cp=1."
        )


def _sharded(local: Tensor, mesh: Any) -> DTensor:
    """``local`` as this rank's ``Shard(2)`` piece of a ``DTensor`` on ``mesh`` (even shards, no communication)."""
    return DTensor.from_local(local, mesh, (Shard(SEQ_DIM),), run_check=False)
