"""Hugging Face transformers v5 causal LMs with the fused linear cross-entropy, their code unedited.

Patching the model's ``loss_function`` is not enough: HF's ``*ForCausalLM.forward`` computes
``lm_head(hidden_states)`` before it calls ``loss_function``, so the ``[B, S, V]`` logits would exist anyway.
Instead :func:`hf_causal_lm_loss` runs the model's own forward with ``logits_to_keep`` an empty index tensor (HF
slices the hidden states with it before the head: ``[B, 0, V]`` logits, no memory; at ``tp > 1`` one position per
rank) and without ``labels``, takes the base model's ``last_hidden_state`` (the final norm's output) from a forward
hook held for that one call, and computes HF's loss from it with :func:`head_cross_entropy` and ``lm_head``'s weight
(its rows over tp at ``tp > 1``): HF's shift (position ``i`` predicts label ``i + 1``, the last position ignored),
``ignore_index=-100``, the mean over the labelled tokens, plus ``router_aux_loss_coef * aux_loss`` where the model
computed its load-balancing loss (``output_router_logits``).

Shape legend: B batch, S sequence, D hidden.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_moe_overlap.loss.fused import DEFAULT_CHUNK_SIZE
from lightning_moe_overlap.loss.tokens import IGNORE_INDEX  # HF's label for "no loss here"
from lightning_moe_overlap.loss.vocab_parallel import check_vocab_parallel_head, head_cross_entropy, plain_loss



def shift_labels(labels_BS: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """HF's causal shift (``ForCausalLMLoss``): position ``i``'s target is ``labels[i + 1]``; the last position's is
    ``ignore_index``."""
    return F.pad(labels_BS, (0, 1), value=ignore_index)[..., 1:]


def lm_head_loss(
    hidden_BSD: Tensor, lm_head: nn.Module, labels_BS: Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE,
    num_items: Tensor | None = None, shifted: bool = False,
) -> Tensor:
    """HF's causal-LM loss of ``lm_head(hidden_BSD)`` against the unshifted ``labels_BS``, without the logits (the
    last pipeline stage's loss, and :func:`hf_causal_lm_loss`'s). A vocabulary-parallel head (``tp > 1``): the
    rank's rows, the sequence-parallel ``hidden_BSD`` gathered over tp (:func:`head_cross_entropy`).
    ``num_items``: the sum over the labelled tokens divided by it (HF's ``num_items_in_batch``), not their mean.
    ``shifted``: ``labels_BS`` are each position's targets already (:func:`shift_labels` of the whole sequence, as
    context parallelism shards them)."""
    loss = head_cross_entropy(
        hidden_BSD, lm_head.weight, labels_BS if shifted else shift_labels(labels_BS),
        bias=getattr(lm_head, "bias", None),
        ignore_index=IGNORE_INDEX, chunk_size=chunk_size, reduction="mean" if num_items is None else "sum",
    )
    return loss if num_items is None else loss / num_items


def hf_causal_lm_loss(
    hf_model: nn.Module, model_kwargs: dict[str, Tensor], *, chunk_size: int = DEFAULT_CHUNK_SIZE,
    num_items: Tensor | None = None, aux_weight: float = 1.0,
) -> Tensor:
    """The loss HF's ``hf_model(**model_kwargs).loss`` computes (``labels`` among the kwargs), without its logits;
    ``num_items`` and ``aux_weight`` as in :func:`hf_loss`.

    ``hf_model`` is a v5 ``*ForCausalLM``: ``hf_model.model`` the base model, ``hf_model.lm_head`` the head, a
    forward that takes ``logits_to_keep``. Raises ``NotImplementedError`` for a model whose logits are transformed
    after the head (``final_logit_softcapping``, ``logit_scale``), which the fused loss does not apply.
    """
    check_plain_head(hf_model)
    kwargs = dict(model_kwargs)
    labels_BS = kwargs.pop("labels")
    hidden_BSD, output = final_hidden_states(hf_model, kwargs)
    loss = lm_head_loss(hidden_BSD, hf_model.lm_head, labels_BS, chunk_size=chunk_size, num_items=num_items)
    aux_loss = getattr(output, "aux_loss", None)
    if aux_loss is not None:  # HF adds it when it computed it and labels were given
        loss = loss + _weighted(hf_model.router_aux_loss_coef, aux_weight) * aux_loss.to(loss.device)
    return loss


def _weighted(coef: float, weight: float) -> float:
    return coef if weight == 1.0 else coef * weight


def hf_loss(
    hf_model: nn.Module, model_kwargs: dict[str, Tensor], *, num_items: Tensor | None = None, aux_weight: float = 1.0
) -> Tensor:
    """HF's own loss of ``model_kwargs`` (with ``labels``) as a plain tensor: ``hf_model(**model_kwargs).loss``.

    With a vocabulary-parallel head (``tp > 1``: the logits a ``DTensor``, the cross-entropy torch's
    ``loss_parallel``) the forward runs without labels, the loss is the model's own ``loss_function`` on the sharded
    logits, made plain, and the router's auxiliary loss (``output_router_logits``) is added after it as HF adds it:
    inside HF's forward the plain auxiliary loss would be added to the ``DTensor`` cross-entropy, whose backward
    ``DTensor`` refuses ("got mixed torch.Tensor and DTensor").

    ``num_items``: the token losses' sum is divided by it (HF's ``num_items_in_batch``: ``loss/tokens.py``'s
    ``step_tokens``), not by the labelled tokens of ``model_kwargs``. ``aux_weight``: the router's auxiliary loss
    (``output_router_logits``) is added as ``router_aux_loss_coef * aux_weight * aux_loss``."""
    head = getattr(hf_model, "lm_head", None)
    extra = {} if num_items is None else {"num_items_in_batch": num_items}
    if (head is None or not isinstance(head.weight, DTensor)) and aux_weight == 1.0:
        return hf_model(**model_kwargs, **extra).loss
    kwargs = dict(model_kwargs)
    labels = kwargs.pop("labels")
    output = hf_model(**kwargs)
    if isinstance(output.logits, DTensor) and num_items is not None:  # the sum made plain, then divided
        vocab = hf_model.config.vocab_size
        loss = plain_loss(hf_model.loss_function(output.logits, labels, vocab_size=vocab, num_items_in_batch=1))
        loss = loss / num_items
    else:
        loss = plain_loss(hf_model.loss_function(output.logits, labels, vocab_size=hf_model.config.vocab_size, **extra))
    aux_loss = getattr(output, "aux_loss", None)
    if aux_loss is not None:
        loss = loss + _weighted(hf_model.router_aux_loss_coef, aux_weight) * plain_loss(aux_loss).to(loss.device)
    return loss


def final_hidden_states(hf_model: nn.Module, model_kwargs: dict[str, Tensor]) -> tuple[Tensor, Any]:
    """``hf_model``'s forward on ``model_kwargs`` (no ``labels``) without its head's logits (``logits_to_keep``:
    :func:`_positions_to_keep`): the base model's ``last_hidden_state`` ``[B, S, D]`` (the final norm's output, from
    a forward hook held for this one call) and the forward's output (its ``aux_loss`` / ``router_logits``)."""
    captured: list[Tensor] = []
    caller = threading.get_ident()  # a recompute on another thread (the overlap's backward) is not this forward

    def keep_hidden(module: nn.Module, args: Any, output: Any) -> None:
        if threading.get_ident() == caller and not captured:
            captured.append(output.last_hidden_state)

    handle = hf_model.model.register_forward_hook(keep_hidden)
    try:
        device = next(t.device for t in model_kwargs.values() if isinstance(t, Tensor))
        output = hf_model(**model_kwargs, logits_to_keep=_positions_to_keep(hf_model.lm_head, device))
    finally:
        handle.remove()
    return captured[0], output


def _positions_to_keep(lm_head: nn.Module, device: torch.device) -> Tensor:
    """The ``logits_to_keep`` of the forward whose logits are not used: no position; with a vocabulary-parallel head
    (``tp > 1``) the first position of each rank's sequence shard (``[B, tp, V / tp]`` logits on a rank), since
    torch's ``DTensor`` cannot view the zero-size output of the sharded head's matmul ("integer modulo by zero" in
    ``aten._unsafe_view``'s sharding propagation, torch 2.13)."""
    count = 1 if isinstance(lm_head.weight, DTensor) else 0
    return torch.zeros(count, dtype=torch.long, device=device)


def check_plain_head(hf_model: nn.Module) -> None:
    """``NotImplementedError`` for an HF model whose logits are more than ``lm_head(hidden)``, or whose head is a
    ``DTensor`` split otherwise than by rows over one mesh dimension (``check_vocab_parallel_head``)."""
    head = getattr(hf_model, "lm_head", None)
    if head is not None and isinstance(head.weight, DTensor):
        check_vocab_parallel_head(head.weight, getattr(head, "bias", None), "fused cross-entropy")
    config = getattr(hf_model, "config", None)
    for name in ("final_logit_softcapping", "logit_scale"):
        value = getattr(config, name, None)
        if value is not None:
            raise NotImplementedError(
                f"fused cross-entropy: {type(hf_model).__name__} has config.{name}={value!r}, a transform of the "
                "logits after the LM head. Rule: the fused loss computes lm_head(hidden) only. Fix: leave "
                "fused_cross_entropy off for this model."
            )
