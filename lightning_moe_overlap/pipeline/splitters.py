"""The built-in splitter: Hugging Face transformers v5 decoder LMs; and :func:`count_layers` for every model.

It keeps the unsplit model's module names inside a chunk (layers in an ``nn.ModuleDict`` keyed by their global
index, torchtitan's way), so a chunk's state-dict keys are the unsplit model's, minus any prefix above the model.

Every other model cuts itself through the public hook, ``configure_pipeline(layout) -> PipelineChunks`` plus a
``pipeline_num_layers`` attribute (docs/pipeline.md, "The hook for other models"). This package's demo ``MoEGPT``
is such a model: its splitter lives next to it in ``demo.py``, as a user's would, so the library never imports the
demo.

Shape legend: B batch, S sequence, D hidden, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

import torch.distributed as dist

from lightning_moe_overlap.hf.context import ring_inputs
from lightning_moe_overlap.loss.hf import IGNORE_INDEX, check_plain_head, lm_head_loss
from lightning_moe_overlap.loss.tokens import scope_of, step_tokens
from lightning_moe_overlap.loss.vocab_parallel import plain_loss
from lightning_moe_overlap.pipeline.batches import lm_batch
from lightning_moe_overlap.config.pipeline_layout import Chunk, PipelineLayout
from lightning_moe_overlap.parallel.context_module import ATTR as CP_ATTR
from lightning_moe_overlap.parallel.context_module import ContextParallel
from lightning_moe_overlap.pipeline.chunks import PipelineChunks, PipelineSplittable, Splitter

NUM_LAYERS_ATTR = "pipeline_num_layers"  # how a model with configure_pipeline says its number of decoder layers


def builtin_splitter(model: nn.Module) -> Splitter:
    """The splitter for ``model``, or a ``TypeError`` with the hook to implement."""
    if find_hf_decoder(model) is not None:
        return split_hf_decoder
    raise TypeError(
        f"split_model: no built-in splitter knows {type(model).__name__}. Rule: built in are Hugging Face "
        "transformers v5 decoder LMs (model.model.layers, also as a LightningModule's `model`); other models (MoEGPT "
        "among them) cut themselves. Fix: give the model a configure_pipeline(layout) -> PipelineChunks method, or "
        "pass split_model(..., splitter=fn)."
    )


def count_layers(model: nn.Module) -> int:
    """The decoder layers of ``model``: the ``num_layers`` to build its :class:`PipelineLayout` with.

    HF v5 decoder LMs: the length of their layers ``nn.ModuleList``. A model that cuts itself
    (``configure_pipeline``, ``MoEGPT`` among them) says it with a ``pipeline_num_layers`` attribute, which also
    overrides the count of a built-in model. Raises ``TypeError`` for a model that is neither, with the hook to
    implement.
    """
    value = getattr(model, NUM_LAYERS_ATTR, None)
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"count_layers: {type(model).__name__}.{NUM_LAYERS_ATTR}={value!r}. Rule: the number of decoder "
                "layers configure_pipeline cuts, an integer >= 1. Fix: set it to the length of the model's layer "
                "list."
            )
        return value
    hf = find_hf_decoder(model)
    if hf is not None:
        return len(hf.model.layers)
    if isinstance(model, PipelineSplittable):
        raise TypeError(
            f"count_layers: {type(model).__name__} cuts itself (configure_pipeline) but does not say how many "
            f"decoder layers the layout places. Rule: such a model has a `{NUM_LAYERS_ATTR}` attribute (an int). "
            f"Fix: set `self.{NUM_LAYERS_ATTR} = len(self.<your layers>)` in its __init__."
        )
    raise TypeError(
        f"count_layers: no built-in splitter knows {type(model).__name__}, so its decoder layers are unknown. Rule: "
        "built in are Hugging Face transformers v5 decoder LMs (model.model.layers, also as a LightningModule's "
        "`model`); other models (MoEGPT among them) cut themselves. Fix: give the model a configure_pipeline(layout) "
        f"-> PipelineChunks method and a `{NUM_LAYERS_ATTR}` attribute (docs/pipeline.md, 'The hook for other "
        "models')."
    )


def check_layers(model: nn.Module, layout: PipelineLayout, num_layers: int) -> None:
    """A ``ValueError`` unless ``layout`` places ``num_layers`` decoder layers and no MTP layer (for splitters of
    models without MTP layers, built in or a model's own ``configure_pipeline``)."""
    if layout.num_layers != num_layers:
        raise ValueError(
            f"split_model: the layout holds {layout.num_layers} layers but {type(model).__name__} has {num_layers}. "
            f"Rule: the layout places every decoder layer once. Fix: build_layout(num_layers={num_layers}, ...)."
        )
    if any(c.mtp_layers for c in layout.chunks):
        raise ValueError(
            f"split_model: the layout has MTP layers ('m') but {type(model).__name__} has none. Rule: one 'm' per "
            "MTP layer of the model. Fix: remove the 'm' symbols."
        )


# -- Hugging Face transformers v5 decoder LMs ------------------------------------------------------------------
def find_hf_decoder(model: nn.Module) -> nn.Module | None:
    """The HF ``*ForCausalLM`` in ``model`` (itself or its ``model`` attribute), or None."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - depends on the environment
        return None
    for candidate in (model, getattr(model, "model", None)):
        inner = getattr(candidate, "model", None)
        if (
            isinstance(candidate, PreTrainedModel)
            and isinstance(getattr(inner, "layers", None), nn.ModuleList)
            and all(hasattr(inner, a) for a in ("embed_tokens", "norm", "rotary_emb"))
            and hasattr(candidate, "lm_head")
        ):
            return candidate
    return None


class HFDecoderChunk(nn.Module):
    """A run of an HF decoder's layers; names as in the ``*ForCausalLM`` (``model.layers.<i>``, ``lm_head``).

    Every chunk rebuilds what the layers need, as the HF model does: position ids (``0..S-1`` unless given), the
    rotary embedding and the causal mask (with the padding mask when given); no KV cache (training). The attention
    mask and position ids reach every chunk as keyword inputs (``PipelineChunks.chunk_kwargs``). With sequence
    parallelism (:attr:`sequence_shards` set to tp by the strategy) a chunk whose input comes from an earlier chunk's
    layers holds ``S / tp`` of its positions, and builds those tensors for the whole ``S`` (the attention gathers
    the sequence).
    """

    sequence_shards: int = 1  # SEQUENCE_SHARDS_ATTR (pipeline/chunks.py)

    def __init__(
        self, config: Any, parts: dict[str, nn.Module | None], layers: dict[int, nn.Module], *, project: bool = True
    ) -> None:
        super().__init__()
        self.project = project  # False: the last chunk returns the final norm's output (the fused loss's input)
        self.config = config
        self.model = nn.Module()
        for name in ("embed_tokens", "norm", "rotary_emb"):
            if parts[name] is not None:
                setattr(self.model, name, parts[name])
        self.model.layers = nn.ModuleDict({str(i): layer for i, layer in layers.items()})
        self.lm_head = parts["lm_head"]

    def forward(  # input_ids_BS (chunk 0) or hidden_BSD; attention_mask_BS, position_ids_BS as the batch gave them
        self, x: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        inner = self.model
        h_BSD = inner.embed_tokens(x) if hasattr(inner, "embed_tokens") else x
        if len(inner.layers):
            whole_BSD = self._whole_sequence(h_BSD)
            if position_ids is None:
                position_ids = torch.arange(whole_BSD.shape[1], device=h_BSD.device).unsqueeze(0)
            masks = _causal_masks(self.config, whole_BSD, position_ids, attention_mask)
            rotary = inner.rotary_emb(whole_BSD, position_ids=position_ids)
            for i, layer in inner.layers.items():
                h_BSD = layer(
                    h_BSD, attention_mask=masks(int(i)), position_ids=position_ids, use_cache=False,
                    position_embeddings=rotary,
                )
        if self.lm_head is not None:
            h_BSD = inner.norm(h_BSD)
            if self.project:
                h_BSD = self.lm_head(h_BSD)  # logits_BSV
        return h_BSD


    def _whole_sequence(self, h_BSD: Tensor) -> Tensor:
        """``h_BSD``, or at ``sequence_shards > 1`` when it holds the rank's ``S / tp`` positions (it comes from an
        earlier chunk's layers) a view of the whole sequence's shape: what the positions and masks are built from."""
        starts = hasattr(self.model, "embed_tokens") or "0" in self.model.layers
        if self.sequence_shards == 1 or starts:
            return h_BSD
        return h_BSD[:, :1].expand(-1, h_BSD.shape[1] * self.sequence_shards, -1)


def _causal_masks(
    config: Any, h_BSD: Tensor, position_ids: Tensor, attention_mask: Tensor | None
) -> Callable[[int], Any]:
    """Layer index -> its attention mask, as the HF model builds them (per ``config.layer_types`` when set)."""
    import inspect

    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    cache = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
    kwargs = {"config": config, "inputs_embeds": h_BSD, "attention_mask": attention_mask, cache: None,
              "position_ids": position_ids}  # fmt: skip
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        built = {"full_attention": create_causal_mask(**kwargs)}
        if "sliding_attention" in layer_types:
            built["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
        return lambda i: built[layer_types[i]]
    sliding = getattr(config, "sliding_window", None) is not None
    mask = (create_sliding_window_causal_mask if sliding else create_causal_mask)(**kwargs)
    return lambda i: mask


def context_parallel_of(owner: nn.Module) -> ContextParallel | None:
    """The strategy's context-parallel handle on ``owner`` (the module it trains; set at ``cp > 1``, after the cut),
    read at each call."""
    return getattr(owner, CP_ATTR, None)


def _hf_loss_fn(owner: nn.Module, hf: nn.Module) -> Callable[[Tensor, Tensor], Tensor]:
    """The model's own ``loss_function`` of the last chunk's logits (it shifts the labels, -100: no loss), its sum
    over the labelled tokens divided by ``step_tokens`` of ``owner`` (the module the strategy trains:
    ``loss/tokens.py``); at ``tp > 1`` (vocabulary-sharded logits, ``loss_parallel``) its plain value. At ``cp > 1``
    the labels arrive shifted and sharded (``shift_labels``) and the sum is divided by :func:`_cp_items`."""
    loss_function, vocab_size = hf.loss_function, hf.config.vocab_size

    def loss_fn(logits_BSV: Tensor, labels_BS: Tensor) -> Tensor:
        cp = context_parallel_of(owner)
        if cp is None:
            num_items = step_tokens(owner, {"labels": labels_BS})
            return plain_loss(loss_function(logits_BSV, labels_BS, vocab_size, num_items_in_batch=num_items))
        return plain_loss(loss_function(
            logits_BSV, None, vocab_size, shift_labels=labels_BS, num_items_in_batch=_cp_items(owner, labels_BS, cp)
        ))  # fmt: skip

    return loss_fn


def _hf_fused_loss_fn(
    owner: nn.Module, hf: nn.Module, last: HFDecoderChunk, chunk_size: int
) -> Callable[[Tensor, Tensor], Tensor]:
    """The same loss from the last chunk's final-norm output and its ``lm_head`` (read at each call: the weight the
    strategy has put in place by then), without the logits."""
    check_plain_head(hf)

    def loss_fn(h_BSD: Tensor, labels_BS: Tensor) -> Tensor:
        cp = context_parallel_of(owner)
        if cp is None:
            num_items = step_tokens(owner, {"labels": labels_BS})
            return lm_head_loss(h_BSD, last.lm_head, labels_BS, chunk_size=chunk_size, num_items=num_items)
        return lm_head_loss(h_BSD, last.lm_head, labels_BS, chunk_size=chunk_size,
                            num_items=_cp_items(owner, labels_BS, cp), shifted=True)  # fmt: skip

    return loss_fn


def _cp_items(owner: nn.Module, shifted_BS: Tensor, cp: ContextParallel) -> Tensor:
    """What a cp rank's token sum is divided by, ``N / cp``, so that the mean over the cp ranks is the sum over the
    whole sequences divided by ``N`` (the ranks keep unequal numbers of labelled tokens; ``hf/context.py``): ``N``
    the step's count in the strategy's training step (counted on the whole batch, ``loss/tokens.py``), else the
    micro-batch's labelled tokens summed over the cp group (an all-reduce)."""
    scope = scope_of(owner)
    tokens = None if scope is None else scope.take()
    if tokens is not None:
        return tokens.divisor / cp.size
    count = (shifted_BS != IGNORE_INDEX).sum().to(torch.float32)
    dist.all_reduce(count, group=cp.attention.mesh.get_group())
    return count.clamp(min=1) / cp.size


def split_hf_decoder(
    model: nn.Module, layout: PipelineLayout, *, fused_chunk_size: int | None = None
) -> PipelineChunks:
    """An HF v5 ``*ForCausalLM`` (or a module holding it as ``model``): ``model.model.layers`` per the layout.

    ``fused_chunk_size``: the last chunk returns the final norm's output and the loss applies the ``lm_head`` it
    holds in blocks of that size (``loss/hf.py``, ``lm_head_loss``: the ``[B, S, V]`` logits never exist); None:
    logits and the model's own ``loss_function``.

    At ``cp > 1`` (the strategy's ``context_parallel`` on ``model``) each micro-batch is what ``hf/context.py`` gives
    the unsplit model: the labels shifted on the whole sequence, then the input ids and labels sharded over the cp
    ranks, the kept tokens' global position ids to every chunk, the attention the ring's (no mask; padding and packed
    documents refused, rule ``cp-hf-batch``) and each rank's token sum divided by ``N / cp``."""
    hf = find_hf_decoder(model)
    inner = hf.model
    check_layers(model, layout, len(inner.layers))
    if getattr(hf.config, "output_router_logits", False):
        raise NotImplementedError(
            f"split_model: {type(hf).__name__} has config.output_router_logits=True: its load-balancing loss needs "
            "every layer's router logits on the last chunk, which pipeline chunks do not pass on. Rule: HF "
            "router aux losses are off under pp > 1. Fix: set config.output_router_logits=False."
        )

    def chunk(c: Chunk) -> HFDecoderChunk:
        parts = {
            "embed_tokens": inner.embed_tokens if c.embedding else None,
            "norm": inner.norm if c.loss else None,
            "rotary_emb": inner.rotary_emb if c.layers else None,
            "lm_head": hf.lm_head if c.loss else None,
        }
        return HFDecoderChunk(hf.config, parts, {i: inner.layers[i] for i in c.layers}, project=project)

    project = fused_chunk_size is None
    chunks = [chunk(c) for c in layout.chunks]
    loss_fn = _hf_loss_fn(model, hf) if project else _hf_fused_loss_fn(model, hf, chunks[-1], fused_chunk_size)

    owner = type(hf).__name__

    def prepare_batch(batch: Any) -> tuple[tuple[Tensor, ...], Tensor]:
        lm = lm_batch(batch, owner)
        cp = context_parallel_of(model)
        if cp is None:
            return (lm.input_ids,), lm.labels
        input_ids_BS, shifted_BS, _ = ring_inputs(hf, cp, lm.model_kwargs())  # as hf/context.py for pp = 1
        return (input_ids_BS,), shifted_BS

    def chunk_kwargs(batch: Any) -> dict[str, Tensor]:
        lm = lm_batch(batch, owner)
        cp = context_parallel_of(model)
        if cp is None:
            return lm.attention_kwargs()
        _, positions_1S = cp.shard(lm.input_ids)  # the kept tokens' global positions, for the rotary embedding
        return {"position_ids": positions_1S.expand(lm.input_ids.size(0), -1).contiguous()}

    return PipelineChunks(
        chunks, loss_fn, prepare_batch, hf._init_weights, chunk_kwargs=chunk_kwargs, token_loss=True, cp_sharded=True
    )
