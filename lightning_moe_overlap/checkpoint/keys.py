"""Layout-free names for expert tensors, and the model state dict in that form.

An expert-parallel rank holds experts ``[first, first + n)`` of each experts module under the unsharded module's
parameter names, stacked along dim 0 (``gate_up_proj [n, 2F, D]``, ``down_proj [n, D, F]``, biases ``[n, ...]``:
:class:`~lightning_moe_overlap.moe.ep.ExpertParallelExperts` checks that every per-expert tensor leads with the
expert dimension). The *canonical* state dict splits those stacks into one entry per global expert::

    layers.0.mlp.experts.gate_up_proj [n, 2F, D]  ->  layers.0.mlp.experts.gate_up_proj[4]  [2F, D]
                                                       layers.0.mlp.experts.gate_up_proj[5]  [2F, D]  ...

so a key names the same tensor whatever the ep size: every rank writes the experts it owns under keys no other
ep rank has, and a rank of another layout reads exactly the experts it owns now. Dense entries keep their names.

Shape legend: n local experts, E experts of the module.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_moe_overlap.moe.ep import ExpertParallelExperts, ExpertShard

_EXPERT_KEY = re.compile(r"^(?P<name>.+)\[(?P<expert>\d+)\]$")


def expert_key(name: str, expert: int) -> str:
    """The canonical key of global expert ``expert`` of the per-expert tensor ``name``: ``name[expert]``."""
    return f"{name}[{expert}]"


def split_key(key: str) -> tuple[str, int | None]:
    """``("name", expert)`` for an expert key, ``(key, None)`` for any other key."""
    match = _EXPERT_KEY.match(key)
    if match is None:
        return key, None
    return match["name"], int(match["expert"])


def expert_shards(module: nn.Module) -> dict[str, ExpertShard]:
    """``{state-dict name: ExpertShard}`` for every per-expert tensor of the expert-parallel modules of ``module``."""
    shards: dict[str, ExpertShard] = {}
    for prefix, child in module.named_modules():
        if isinstance(child, ExpertParallelExperts):
            dot = f"{prefix}." if prefix else ""
            for name in [*child._parameters, *child._buffers]:
                shards[f"{dot}{name}"] = child.expert_shard
    return shards


def to_canonical(state: Mapping[str, Any], shards: Mapping[str, ExpertShard]) -> dict[str, Any]:
    """Split each local expert stack ``[n, ...]`` into one entry per global expert; other entries are kept."""
    out: dict[str, Any] = {}
    for name, value in state.items():
        shard = shards.get(name)
        if shard is None:
            out[name] = value
            continue
        _check_leading(name, value, shard.num_local, "local experts")
        for i, expert in enumerate(shard.global_range):
            out[expert_key(name, expert)] = value[i]
    return out


def from_canonical(canonical: Mapping[str, Any], shards: Mapping[str, ExpertShard]) -> dict[str, Any]:
    """The inverse of :func:`to_canonical`: stack this rank's experts back into ``[n, ...]`` under the plain name.

    Entries for experts this rank does not hold are ignored.
    """
    out: dict[str, Any] = {}
    expert_names: dict[str, None] = {}  # ordered: every rank must list its tensors in the same order
    for key, value in canonical.items():
        name, expert = split_key(key)
        if expert is None:
            out[key] = value
        else:
            expert_names.setdefault(name)
            out.setdefault(name, None)  # keep the position of the first expert
    for name in expert_names:
        shard = shards.get(name)
        if shard is None:
            raise ValueError(
                f"the state holds per-expert entries `{name}[i]` but the model has no expert-parallel tensor "
                f"`{name}` (its per-expert tensors: {sorted(shards)[:5]}). Load it into the model it was saved from."
            )
        missing = [e for e in shard.global_range if expert_key(name, e) not in canonical]
        if missing:
            raise ValueError(
                f"the state lacks experts {missing} of `{name}`, which this rank holds (experts "
                f"{shard.first_expert}..{shard.first_expert + shard.num_local - 1} of {shard.num_experts}). "
                "A checkpoint must hold every expert; load a complete one."
            )
        out[name] = torch.stack([canonical[expert_key(name, e)] for e in shard.global_range])
    return out


def full_to_canonical(full: Mapping[str, Any], shards: Mapping[str, ExpertShard]) -> dict[str, Any]:
    """From an unsharded state dict (``[E, ...]`` expert tensors): this rank's experts, one entry per expert."""
    out: dict[str, Any] = {}
    for name, value in full.items():
        shard = shards.get(name)
        if shard is None:
            out[name] = value
            continue
        _check_expert_count(name, value, shard.num_experts)
        for expert in shard.global_range:
            out[expert_key(name, expert)] = value[expert]
    return out


def canonical_to_full(canonical: Mapping[str, Any]) -> dict[str, Any]:
    """Stack every expert of every per-expert tensor back into ``[E, ...]``: the unsharded model's state dict.

    Raises:
        ValueError: the experts of a tensor are not exactly ``0..E-1`` (the checkpoint is missing some).
    """
    out: dict[str, Any] = {}
    experts: dict[str, dict[int, Any]] = {}
    for key, value in canonical.items():
        name, expert = split_key(key)
        if expert is None:
            out[key] = value
        else:
            experts.setdefault(name, {})[expert] = value
            out.setdefault(name, None)  # keep the order of first appearance
    for name, pieces in experts.items():
        if sorted(pieces) != list(range(len(pieces))):
            missing = sorted(set(range(max(pieces) + 1)) - set(pieces))
            raise ValueError(
                f"`{name}` has experts {sorted(pieces)[:8]}... but lacks {missing[:8]}; a consolidated tensor needs "
                "every expert 0..E-1. The checkpoint is incomplete: consolidate a complete one."
            )
        out[name] = torch.stack([pieces[e] for e in range(len(pieces))])
    return out


def saved_expert_counts(keys: Iterable[str]) -> dict[str, int]:
    """``{name: number of experts}`` from canonical keys (``1 + the highest expert index``)."""
    counts: dict[str, int] = {}
    for key in keys:
        name, expert = split_key(key)
        if expert is not None:
            counts[name] = max(counts.get(name, 0), expert + 1)
    return counts


def check_expert_counts(saved: Mapping[str, int], shards: Mapping[str, ExpertShard], where: str) -> None:
    """Raise when a per-expert tensor was saved with another number of experts than the model has.

    Raises:
        ValueError: the counts differ (names the tensor, both counts, the rule and the fix).
    """
    for name, shard in shards.items():
        if name in saved and saved[name] != shard.num_experts:
            raise ValueError(
                f"the checkpoint at {where} holds {saved[name]} experts for `{name}` but the model has "
                f"{shard.num_experts}. A checkpoint loads at any ep that divides its number of experts, but the "
                f"number of experts itself must match. Load it into a model built with {saved[name]} experts."
            )


def check_keys(saved: Mapping[str, Any], wanted: Mapping[str, Any], where: str, *, strict: bool) -> None:
    """Raise when the saved keys and shapes do not fit the model (``None`` shape: not a tensor, not compared).

    Raises:
        ValueError: a key the model needs is missing or a saved key is unknown to it (``strict``), or a shape
            differs (always).
    """
    missing = [k for k in wanted if k not in saved]
    unexpected = [k for k in saved if k not in wanted]
    shapes = [
        f"{k}: saved {tuple(saved[k])}, model {tuple(wanted[k])}"
        for k in wanted
        if k in saved and saved[k] is not None and wanted[k] is not None and tuple(saved[k]) != tuple(wanted[k])
    ]
    if shapes:
        raise ValueError(
            f"the checkpoint at {where} does not fit the model: {len(shapes)} tensors differ in shape "
            f"({'; '.join(shapes[:3])}). A checkpoint loads only into the model it was saved from (any ep size). "
            "Build the model with the configuration it was saved with."
        )
    if strict and (missing or unexpected):
        raise ValueError(
            f"the checkpoint at {where} was saved from a different model: {len(missing)} keys of the model are not "
            f"in it {missing[:5]}, {len(unexpected)} saved keys are not in the model {unexpected[:5]}. A "
            "checkpoint loads only into the model it was saved from (any ep size). Build that model, or set "
            "`strict_loading = False` on the LightningModule to load the keys both have."
        )


def shapes_of(state: Mapping[str, Any]) -> dict[str, torch.Size | None]:
    return {k: (v.shape if isinstance(v, Tensor) else None) for k, v in state.items()}


def _check_leading(name: str, value: Any, count: int, what: str) -> None:
    if not isinstance(value, Tensor) or value.dim() == 0 or value.shape[0] != count:
        shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(
            f"`{name}` is {shape}, but it is a per-expert tensor of a rank holding {count} {what}; per-expert "
            f"tensors must lead with the expert dimension ({count}, ...). Register an adapter whose layout names "
            "only per-expert tensors (docs/adapters.md)."
        )


def _check_expert_count(name: str, value: Any, num_experts: int) -> None:
    if not isinstance(value, Tensor) or value.dim() == 0 or value.shape[0] != num_experts:
        shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(
            f"the checkpoint's `{name}` is {shape} but the model has {num_experts} experts there; a consolidated "
            "checkpoint holds every expert along dim 0, and the number of experts must match the model's. Load "
            "it into a model built with the same number of experts."
        )
