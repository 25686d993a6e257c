"""Hugging Face transformers v5 causal LMs at ``cp > 1``: their own forward on this rank's sequence shard, the loss
and the router's balancing loss counted so that the cp ranks' shares add up to the whole sequence's.

What an HF model needs beyond :meth:`ContextParallel.shard <lightning_moe_overlap.parallel.context_module
.ContextParallel.shard>`:

- **Labels** are shifted on the whole sequence, then sharded with the input ids, and given to the model's own
  ``loss_function`` as ``shift_labels`` (HF's ``ForCausalLMLoss`` then does not shift them again); the model itself is
  called without ``labels``, so its forward adds nothing to the loss.
- **Positions**: the kept tokens' global position ids go to the model, so the rotary embedding sees global positions.
- **Attention** runs as :data:`ATTENTION`, an attention implementation registered with HF's ``AttentionInterface``
  and set per model (``set_attn_implementation``; other models in the process keep theirs): one
  ``torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)`` call with no mask, which the
  strategy's ring takes (``parallel/context_attention.py``). It has no mask function, so HF's ``create_causal_mask``
  builds no mask: with ``sdpa`` it would read the head-tail shard's jumping position ids as packed sequences and build
  a block mask over the shard's own length. A padded ``attention_mask`` and packed ``position_ids`` are refused (rule
  ``cp-hf-batch``): causal attention over the whole row is all the ring computes.
- **Loss average**: each rank's loss is the sum over its tokens divided by ``N / cp`` (``num_items_in_batch``), ``N``
  the labelled tokens of the whole micro-batch (every cp rank has the whole batch before sharding: no
  communication); the last label of each sequence is ignored, so the ranks keep unequal numbers of labelled tokens and
  a per-rank mean would weigh them wrong. The mean over the cp ranks is then the whole micro-batch's mean.
- **Router balancing loss** (``config.output_router_logits``): HF's ``load_balancing_loss_func`` is a product of
  per-token means, so over a shard it is not the sequence's. Here the expert counts are summed over the cp group
  (an all-reduce, no gradient, as the routers of this package do); each rank's loss is ``cp x E x sum_e f_e P_e^r``
  with ``f_e`` the whole micro-batch's routed fraction and ``P_e^r`` this rank's routing-probability sum over the
  micro-batch's rows: the mean over the cp ranks is HF's balancing loss of the whole micro-batch, and so is its
  gradient. At ``tp > 1`` a rank's router logits are its sequence-parallel rows: the counts are summed over the
  ``cp x tp`` ranks and each tp rank reports its cp rank's share (:func:`balancing_loss_share`).

Shape legend: B batch, T sequence, S = T / cp this rank's tokens, E experts, R router rows (B x S).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_moe_overlap._compat.transformers import attn_implementation
from lightning_moe_overlap.loss.hf import (
    check_plain_head,
    final_hidden_states,
    lm_head_loss,
    shift_labels,
)
from lightning_moe_overlap.loss.tokens import count_label_tokens
from lightning_moe_overlap.loss.vocab_parallel import plain_loss
from lightning_moe_overlap.parallel.context_module import ContextParallel

ATTENTION = "lightning_moe_overlap_context_parallel"  # the attention implementation's name in HF's registry
RULE = "rule `cp-hf-batch`, docs/validation.md"


def ring_sdpa_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
    dropout: float = 0.0, scaling: float | None = None, **kwargs: Any,
) -> tuple[Tensor, None]:
    """HF's attention-interface signature (``query`` ``[B, H, S, Dh]``, ``key`` / ``value`` ``[B, Hkv, S, Dh]``;
    returns ``[B, S, H, Dh]``): causal SDPA without a mask, the call the context-parallel ring takes. Fewer key /
    value heads than query heads run with ``enable_gqa``; values narrower than the queries and keys (multi-head
    latent attention) are padded with zero columns for the kernel, which needs one width, and cut back after it."""
    sliding_window = kwargs.get("sliding_window")
    problems = [
        f"an attention mask of shape {list(attention_mask.shape)}" if attention_mask is not None else "",
        f"sliding_window={sliding_window}" if sliding_window is not None else "",
        f"softcap={kwargs['softcap']}" if kwargs.get("softcap") is not None else "",
        f"{query.size(2)} queries against {key.size(2)} keys (a cache)" if query.size(2) != key.size(2) else "",
    ]
    if any(problems):
        raise NotImplementedError(
            f"attention `{ATTENTION}` of {type(module).__name__} got {', '.join(p for p in problems if p)}. Rule: at "
            "cp > 1 attention is causal over the whole sequence with no mask, window, softcap or cache (torch's ring "
            "attention). Fix: train without them at cp > 1, or use cp=1."
        )
    qk_dim, v_dim = query.size(-1), value.size(-1)
    scale = scaling if scaling is not None else qk_dim**-0.5
    if v_dim < qk_dim:  # latent attention (DeepSeek): the ring's kernel takes one head width; zero columns add nothing
        value = F.pad(value, (0, qk_dim - v_dim))
    elif qk_dim < v_dim:  # zero columns of the queries and keys leave their products as they are
        query, key = F.pad(query, (0, v_dim - qk_dim)), F.pad(key, (0, v_dim - qk_dim))
    out_BHSD = F.scaled_dot_product_attention(
        query, key, value, dropout_p=dropout, scale=scale, is_causal=True, enable_gqa=key.size(1) != query.size(1)
    )
    return out_BHSD[..., :v_dim].transpose(1, 2).contiguous(), None


def use_ring_attention(hf_model: nn.Module) -> None:
    """Set ``hf_model``'s attention implementation to :data:`ATTENTION` (registered with HF's ``AttentionInterface``
    once; the registry only gains the name, the other models keep their implementation). Idempotent."""
    from transformers import AttentionInterface

    if AttentionInterface().get(ATTENTION) is not ring_sdpa_attention:
        AttentionInterface.register(ATTENTION, ring_sdpa_attention)
    if attn_implementation(hf_model.config) != ATTENTION:
        hf_model.set_attn_implementation(ATTENTION)


def check_batch(model_kwargs: dict[str, Tensor], cp: int) -> None:
    """``ValueError`` for what the ring cannot compute (rule ``cp-hf-batch``): padding in ``attention_mask``, packed
    documents in ``position_ids``."""
    mask_BT = model_kwargs.get("attention_mask")
    if mask_BT is not None and not bool(mask_BT.bool().all()):  # NOTE: D2H sync (once per micro-batch)
        padded = int((mask_BT == 0).sum())  # NOTE: D2H sync (only on the way to the error)
        raise ValueError(
            f"cp={cp}: the batch's attention_mask {list(mask_BT.shape)} marks {padded} padding token(s) ({RULE}). "
            "Rule: at cp > 1 attention is causal over whole rows, with no mask (torch's ring attention takes none). "
            "Fix: pack or cut the sequences to the full length without padding (mark tokens without loss with "
            "labels -100), or use cp=1."
        )
    positions_BT = model_kwargs.get("position_ids")
    if positions_BT is not None:
        plain_T = torch.arange(positions_BT.size(-1), device=positions_BT.device)
        if not bool((positions_BT == plain_T).all()):  # NOTE: D2H sync (once per micro-batch)
            raise ValueError(
                f"cp={cp}: the batch's position_ids {list(positions_BT.shape)} are not 0..{positions_BT.size(-1) - 1} "
                f"on every row (packed documents?) ({RULE}). Rule: at cp > 1 attention is causal over whole rows; "
                "documents packed in a row would attend to each other. Fix: leave position_ids out, or use cp=1."
            )


def ring_inputs(
    hf_model: nn.Module, cp: ContextParallel, model_kwargs: dict[str, Tensor]
) -> tuple[Tensor, Tensor, Tensor]:
    """This cp rank's part of a micro-batch (``model_kwargs``: ``input_ids``, ``labels``, optionally
    ``attention_mask`` / ``position_ids``, all ``[B, T]``) as the ring needs it: the batch checked (rule
    ``cp-hf-batch``), the model's attention the ring's, the labels shifted on the whole sequence, then the input ids
    and shifted labels sharded. Returns ``(input_ids_BS, shifted_BS, positions_1S)``, the kept tokens' global
    positions last (the pipeline chunks take them too, ``pipeline/splitters.py``)."""
    check_batch(model_kwargs, cp.size)
    use_ring_attention(hf_model)
    (input_ids_BS, shifted_BS), positions_1S = cp.shard(model_kwargs["input_ids"], shift_labels(model_kwargs["labels"]))
    return input_ids_BS, shifted_BS, positions_1S


def context_parallel_loss(
    hf_model: nn.Module, cp: ContextParallel, model_kwargs: dict[str, Tensor], *, chunk_size: int | None = None,
    num_items: Tensor | None = None, aux_weight: float = 1.0,
) -> Tensor:
    """This cp rank's share of HF's causal-LM loss of a micro-batch (``model_kwargs``: ``input_ids``, ``labels``,
    optionally ``attention_mask`` / ``position_ids``, all ``[B, T]``): the mean over the cp ranks is HF's
    ``hf_model(**model_kwargs).loss`` of the whole micro-batch. ``chunk_size``: the fused loss (no ``[B, S, V]``
    logits) with that block size; None: the model's own head and ``loss_function``. ``num_items``: the token sum is
    divided by it (the step's count, ``loss/tokens.py``) instead of the micro-batch's labelled tokens;
    ``aux_weight``: the balancing loss's weight (as in ``loss.hf.hf_loss``)."""
    input_ids_BS, shifted_BS, positions_1S = ring_inputs(hf_model, cp, model_kwargs)
    labelled = count_label_tokens(model_kwargs) if num_items is None else num_items
    num_items = labelled.to(torch.float32) / cp.size  # sum over S tokens / (N / cp): the cp mean is the batch mean
    inputs = {"input_ids": input_ids_BS, "position_ids": positions_1S}
    if chunk_size is None:
        output = hf_model(**inputs)
        logits_BSV = output.logits
        loss = hf_model.loss_function(
            logits_BSV, None, logits_BSV.size(-1), shift_labels=shifted_BS, num_items_in_batch=num_items
        )
    else:
        check_plain_head(hf_model)
        hidden_BSD, output = final_hidden_states(hf_model, inputs)  # at tp > 1: the rank's sequence-parallel rows
        loss = lm_head_loss(hidden_BSD, hf_model.lm_head, shifted_BS, chunk_size=chunk_size, num_items=num_items,
                            shifted=True)  # fmt: skip
    loss = plain_loss(loss)  # at tp > 1 a replicated DTensor (the vocabulary-parallel loss)
    if getattr(output, "router_logits", None) is not None and getattr(hf_model.config, "output_router_logits", False):
        aux = balancing_loss_share(hf_model, output.router_logits, cp)
        loss = loss + hf_model.router_aux_loss_coef * aux_weight * aux.to(loss.device)
    return loss


def router_statistics(router_logits: tuple[Tensor, ...], num_experts: int, top_k: int) -> tuple[Tensor, Tensor, int]:
    """HF's ``load_balancing_loss_func`` sums over a forward's layers (no mask): the top-k assignments per expert
    ``counts_E`` (no gradient), the routing probabilities per expert ``probs_E``, and the rows."""
    counts_E = torch.zeros(num_experts, dtype=torch.float32, device=router_logits[0].device)
    probs_E = torch.zeros(num_experts, dtype=torch.float32, device=router_logits[0].device)
    rows = 0
    for logits_RE in router_logits:
        weights_RE = torch.softmax(logits_RE.to(counts_E.device), dim=-1)
        selected_RK = torch.topk(weights_RE, top_k, dim=-1).indices
        counts_E = counts_E + torch.histc(selected_RK.reshape(-1).float(), bins=num_experts, min=0, max=num_experts)
        probs_E = probs_E + weights_RE.float().sum(dim=0)
        rows += logits_RE.size(0)
    return counts_E, probs_E, rows


def balancing_loss_from(counts_E: Tensor, probs_E: Tensor, rows: int, num_experts: int, cp: int) -> Tensor:
    """One rank's share ``cp x E x sum_e (counts_E / rows)(probs_E / rows)``, with the whole micro-batch's ``counts_E``
    and ``rows`` and this rank's ``probs_E``: the shares of the cp ranks average to HF's balancing loss."""
    return cp * num_experts * torch.sum((counts_E / rows) * (probs_E / rows))


def balancing_loss_share(hf_model: nn.Module, router_logits: tuple[Tensor, ...], cp: ContextParallel) -> Tensor:
    """This rank's share of the micro-batch's balancing loss: the counts summed over the ranks holding the parts of
    each sequence (all-reduce over ``cp.sequence_group``). At ``tp > 1`` a rank's router logits hold its
    sequence-parallel rows only, ``1 / (cp x tp)`` of the micro-batch's, and the tp ranks' shares add up: the
    routers are tp replicas whose gradients the strategy sums over tp, while it averages over cp. Each tp rank
    returns the cp rank's share (the sum of its tp ranks', one more all-reduce) with the gradient of its own part,
    so the tp ranks of one cp rank report the same loss, as they do the cross-entropy."""
    num_experts, top_k = (getattr(hf_model, name, None) for name in ("num_experts", "num_experts_per_tok"))
    if num_experts is None or top_k is None:
        raise NotImplementedError(
            f"cp={cp.size}: {type(hf_model).__name__} has config.output_router_logits=True but no `num_experts` / "
            "`num_experts_per_tok` attributes, so its balancing loss cannot be counted over the cp group. Rule: at "
            "cp > 1 the balancing loss of HF's MoE causal LMs (Qwen-MoE, Mixtral, OLMoE) is supported. Fix: set "
            "config.output_router_logits=False, or use cp=1."
        )
    group = cp.sequence_group or cp.attention.mesh.get_group()
    counts_E, probs_E, rows = router_statistics(router_logits, num_experts, top_k)
    dist.all_reduce(counts_E, group=group)
    share = balancing_loss_from(counts_E, probs_E, rows * cp.size * cp.tp, num_experts, cp.size)
    if cp.tp == 1:
        return share
    # the cp rank's share is the sum of its tp ranks' (each of its own rows): that value on each of them, each
    # keeping the gradient of its own part (the tp replicas' gradients are summed)
    slots_C = torch.zeros(cp.size, dtype=share.dtype, device=share.device)
    slots_C[cp.rank] = share.detach()
    dist.all_reduce(slots_C, group=group)
    return share + (slots_C[cp.rank] - share).detach()
