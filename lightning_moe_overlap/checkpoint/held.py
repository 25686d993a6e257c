"""What a rank holds at pp > 1: every tensor that is not on the meta device.

Under pipeline parallelism the LightningModule keeps the *unsplit* model; the parameters and buffers of the chunks
a rank does not run are on the ``meta`` device (docs/pipeline.md). Checkpoints stay keyed by the unsplit model's
names, so "this rank holds key ``k``" is "tensor ``k`` is not on meta": a rank writes and reads only those, and the
keys of the other pp ranks' chunks are *absent* here, neither missing nor unexpected. At pp = 1 nothing is absent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_moe_overlap.checkpoint.keys import split_key


def is_meta(value: Any) -> bool:
    return isinstance(value, Tensor) and value.is_meta


def held(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` without its meta tensors (the entries of chunks another pp rank holds)."""
    return {k: v for k, v in state.items() if not is_meta(v)}


def absent(state: Mapping[str, Any]) -> dict[str, torch.Size]:
    """``{key: shape}`` of the meta tensors of ``state``, under the unsplit model's names."""
    return {k: v.shape for k, v in state.items() if is_meta(v)}


def absent_params(module: nn.Module) -> set[str]:
    """Names of ``module``'s parameters on the meta device."""
    return {n for n, p in module.named_parameters() if p.is_meta}


def is_absent(key: str, names: Mapping[str, Any] | set[str]) -> bool:
    """Whether the canonical ``key`` (``name`` or an expert's ``name[e]``) belongs to a tensor absent here."""
    return split_key(key)[0] in names
