"""The batches the built-in splitters take at ``pp > 1``, read into tensors (docs/pipeline.md, "Batches").

- ``MoEGPT``: a tensor of token ids ``[B, S]``, or a tuple / list holding one (what a ``TensorDataset``'s loader
  yields).
- Hugging Face decoders: the same, or a mapping (a dict, a ``BatchEncoding``) with ``input_ids`` and optionally
  ``labels`` (``-100`` where no loss is taken, e.g. prompt and padding tokens), ``attention_mask`` (1 for tokens, 0
  for padding) and ``position_ids``, each ``[B, S]``: what HF datasets and collators produce. The loss takes the
  given ``labels`` (``input_ids`` without them), as HF's own ``forward(labels=...)`` does.

Anything else raises a ``TypeError`` naming the batch's type (and keys) and the hook that takes other batches: the
model's ``configure_pipeline`` with its own ``prepare_batch``.

Shape legend: B batch, S sequence.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

HF_OPTIONAL_KEYS = ("labels", "attention_mask", "position_ids")
_FIX = (
    "Fix: make the dataloader yield one of these, or give the LightningModule a configure_pipeline(layout) that "
    "returns PipelineChunks with its own prepare_batch(batch) -> (first chunk's inputs, loss target) (e.g. "
    "dataclasses.replace(split_hf_decoder(self, layout), prepare_batch=fn); docs/pipeline.md, 'Batches')."
)


@dataclass(frozen=True)
class LMBatch:
    """A causal-LM batch: token ids, the loss labels, and what attention needs (None: not given)."""

    input_ids: Tensor  # [B, S]
    labels: Tensor  # [B, S], -100 where no loss is taken (input_ids when the batch gave none)
    attention_mask: Tensor | None = None  # [B, S], 1 token / 0 padding
    position_ids: Tensor | None = None  # [B, S]

    def attention_kwargs(self) -> dict[str, Tensor]:
        """The keyword tensors every chunk takes (only those given)."""
        given = {"attention_mask": self.attention_mask, "position_ids": self.position_ids}
        return {k: v for k, v in given.items() if v is not None}

    def model_kwargs(self) -> dict[str, Tensor]:
        """The keyword arguments of the HF model's own ``forward`` (the unsplit model at ``pp = 1``)."""
        return {"input_ids": self.input_ids, "labels": self.labels, **self.attention_kwargs()}


def describe(batch: Any) -> str:
    """A batch's type and, for a mapping, its keys; for a sequence, its items' types."""
    if isinstance(batch, Mapping):
        return f"a {type(batch).__name__} with keys {sorted(map(str, batch))}"
    if isinstance(batch, (tuple, list)):
        items = ", ".join(type(item).__name__ for item in batch)
        return f"a {type(batch).__name__} of {len(batch)} item(s) ({items})"
    if isinstance(batch, Tensor):
        return f"a tensor of shape {list(batch.shape)} and dtype {batch.dtype}"
    return f"a {type(batch).__name__}"


def token_ids(batch: Any, owner: str) -> Tensor:
    """``tokens_BS`` from a tensor or a one-tensor tuple / list (``MoEGPT``'s batches); ``owner`` names the splitter."""
    tokens = _one_tensor(batch)
    if tokens is None or tokens.dim() != 2:
        raise TypeError(
            f"The built-in pipeline split of {owner} got {describe(batch)}. Rule: at pp > 1 it takes a tensor of "
            f"token ids [B, S], or a tuple / list holding one. {_FIX}"
        )
    return tokens


def lm_batch(batch: Any, owner: str) -> LMBatch:
    """An :class:`LMBatch` from a tensor, a one-tensor tuple / list, or a mapping with ``input_ids`` and optionally
    ``labels`` / ``attention_mask`` / ``position_ids`` (Hugging Face decoders' batches)."""
    if not isinstance(batch, Mapping):
        tokens = _one_tensor(batch)
        if tokens is not None and tokens.dim() == 2:
            return LMBatch(tokens, tokens)
        _refuse(batch, owner)
    unknown = sorted(str(k) for k in batch if k not in ("input_ids", *HF_OPTIONAL_KEYS))
    given = {k: batch.get(k) for k in ("input_ids", *HF_OPTIONAL_KEYS) if batch.get(k) is not None}
    input_ids = given.get("input_ids")
    if unknown or not all(isinstance(v, Tensor) for v in given.values()) or not isinstance(input_ids, Tensor):
        _refuse(batch, owner, unknown)
    if input_ids.dim() != 2 or any(v.shape != input_ids.shape for v in given.values()):
        shapes = {k: list(v.shape) for k, v in given.items()}
        raise ValueError(
            f"The built-in pipeline split of {owner} got a batch with shapes {shapes}. Rule: input_ids is [B, S] and "
            "labels / attention_mask / position_ids have its shape. Fix: pad every entry of a sample to the same "
            "length in the collate function."
        )
    return LMBatch(input_ids, given.get("labels", input_ids), given.get("attention_mask"), given.get("position_ids"))


def _one_tensor(batch: Any) -> Tensor | None:
    if isinstance(batch, Tensor):
        return batch
    if isinstance(batch, (tuple, list)) and len(batch) == 1 and isinstance(batch[0], Tensor):
        return batch[0]
    return None


def _refuse(batch: Any, owner: str, unknown: list[str] | None = None) -> None:
    extra = f" (keys it does not know: {unknown})" if unknown else ""
    raise TypeError(
        f"The built-in pipeline split of {owner} got {describe(batch)}{extra}. Rule: at pp > 1 it takes a tensor of "
        "token ids [B, S], a tuple / list holding one, or a dict with 'input_ids' and optionally 'labels' (-100: no "
        f"loss), 'attention_mask', 'position_ids', each a [B, S] tensor. {_FIX}"
    )
