"""The consolidated format: one ``torch.save`` file, exactly what an unsharded single-process run would write.

``state_dict`` holds every expert in the full layout (``gate_up_proj [E, 2F, D]``) under the unsharded model's
names, and ``optimizer_states`` are plain ``optimizer.state_dict()`` dicts with ``[E, ...]`` expert state. So the
file loads into the unsharded LightningModule (``load_from_checkpoint``, ``load_state_dict``), resumes a run at any
layout (including a plain single-device Trainer), and, with the LightningModule's attribute prefix removed
(:func:`load_consolidated_state_dict`), into a Hugging Face model. ``moe_checkpoint`` records the layout that wrote
it and each rank's RNG state.

Writing gathers the experts over the ep group of global rank 0 (``torch.distributed.gather``, one tensor at a
time) and rank 0 writes; :func:`consolidate_checkpoint` converts a sharded directory offline in one process.

Shape legend: n local experts, E experts of the module.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_moe_overlap.checkpoint.atomic import check_not_staging, local_path, publish, staging_path
from lightning_moe_overlap.checkpoint.keys import (
    canonical_to_full,
    check_keys,
    from_canonical,
    full_to_canonical,
    shapes_of,
)
from lightning_moe_overlap.checkpoint.optimizer import (
    canonical_optimizer_to_full,
    full_optimizer_to_canonical,
    optimizer_from_canonical,
)
from lightning_moe_overlap.checkpoint.sharded import read_all
from lightning_moe_overlap.checkpoint.target import LoadTarget
from lightning_moe_overlap.moe.ep import ExpertShard

INFO_KEY = "moe_checkpoint"


# -- gather (collective) ---------------------------------------------------------------------------------------
def gather_full(
    checkpoint: dict[str, Any],
    target: LoadTarget,
    ep_group: dist.ProcessGroup | None,
    rng_state: bytes,
) -> dict[str, Any] | None:
    """The unsharded checkpoint on global rank 0 (``None`` elsewhere) from every rank's canonical checkpoint.

    Collective over the whole world (RNG states) and over the ep group of rank 0 (experts); the other ep groups
    hold replicas of the same experts and send nothing.
    """
    distributed = dist.is_available() and dist.is_initialized()
    rng_states = [rng_state]
    if distributed:
        rng_states = [None] * dist.get_world_size()
        dist.gather_object(rng_state, rng_states if target.rank == 0 else None, dst=0)
    in_group = not distributed or ep_group is None or 0 in dist.get_process_group_ranks(ep_group)
    if not in_group:
        return None
    shards = target.shards
    state = from_canonical(checkpoint["state_dict"], shards)
    state = {k: (_gather(v, ep_group, shards[k]) if k in shards else v) for k, v in state.items()}
    full = {k: v for k, v in checkpoint.items() if k != "optimizer_states"}
    full["state_dict"] = state
    if "optimizer_states" in checkpoint:
        full["optimizer_states"] = [
            _gather_optimizer(optimizer_from_canonical(optim, names, shards, "this run"), names, shards, ep_group)
            for optim, names in zip(checkpoint["optimizer_states"], target.optimizers)
        ]
    full[INFO_KEY] = {"format": "consolidated", "world_size": target.world_size, "rng_states": rng_states}
    return full if target.rank == 0 else None


def _gather(local: Any, group: dist.ProcessGroup | None, shard: ExpertShard) -> Any:
    """``[n, ...]`` on each ep rank -> ``[E, ...]`` on global rank 0 (ep rank r holds experts ``[r*n, (r+1)*n)``)."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return local
    size = dist.get_world_size(group)
    pieces = [torch.empty_like(local) for _ in range(size)] if dist.get_rank() == 0 else None
    dist.gather(local.contiguous(), pieces, dst=0, group=group)
    if pieces is None:
        return None
    full = torch.cat(pieces)
    if full.shape[0] != shard.num_experts:  # pragma: no cover - guarded by the dispatcher's even split
        raise RuntimeError(f"gathered {full.shape[0]} experts, expected {shard.num_experts}")
    return full


def _gather_optimizer(
    local: dict[str, Any], names: list[str], shards: dict[str, ExpertShard], group: dist.ProcessGroup | None
) -> dict[str, Any]:
    state = {}
    for index in sorted(local["state"]):  # the same indices on every ep rank: each steps the same parameters
        entry = dict(local["state"][index])
        shard = shards.get(names[index])
        if shard is not None:
            for key in sorted(entry):
                value = entry[key]
                if isinstance(value, Tensor) and value.dim() > 0:
                    entry[key] = _gather(value, group, shard)
        state[index] = entry
    return {"state": state, "param_groups": local["param_groups"]}


# -- files -----------------------------------------------------------------------------------------------------
def write_file(checkpoint: dict[str, Any], path: Path, token: str) -> None:
    """``torch.save`` to a staging name, then rename: a partly written file never has the final name."""
    staging = staging_path(path, token)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(staging, "wb") as f:
        torch.save(checkpoint, f)
    publish(staging, path, token)


def read_file(path: Path) -> dict[str, Any]:
    """A consolidated checkpoint file, memory-mapped (only the experts a rank takes are paged in)."""
    check_not_staging(path)
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except (RuntimeError, OSError, EOFError) as err:
        raise RuntimeError(
            f"`MoEOverlapStrategy`: the checkpoint file {path} cannot be read ({err}); it is truncated or not a "
            "torch checkpoint. Load a complete checkpoint: a committed sharded directory or a consolidated file."
        ) from err


def read_consolidated(path: Path, target: LoadTarget) -> tuple[dict[str, Any], bytes | None]:
    """This rank's part of a consolidated file in canonical form, and its RNG state when the world size matches.

    Raises:
        ValueError: the checkpoint does not fit the model (expert count, keys, shapes, optimizer parameters).
    """
    full = read_file(path)
    out = {k: v for k, v in full.items() if k not in ("state_dict", "optimizer_states")}
    state = full_to_canonical(full["state_dict"], target.shards)
    check_keys(shapes_of(state), target.model, str(path), strict=target.strict)
    out["state_dict"] = {k: v for k, v in state.items() if k in target.model}
    if "optimizer_states" in full:
        out["optimizer_states"] = [
            full_optimizer_to_canonical(osd, names, target.shards, str(path))
            for osd, names in zip(full["optimizer_states"], target.optimizers)
        ]
    info = full.get(INFO_KEY) or {}
    rng_states = info.get("rng_states") or []
    same_world = info.get("world_size") == target.world_size and target.rank < len(rng_states)
    return out, (rng_states[target.rank] if same_world else None)


# -- offline ---------------------------------------------------------------------------------------------------
def consolidate_checkpoint(source: str | os.PathLike, destination: str | os.PathLike) -> Path:
    """Convert a sharded checkpoint directory into one consolidated file, in this process (no process group).

    Reads every tensor, so it needs the memory of the whole checkpoint (model and optimizer state).

    Returns:
        The path of the written file.

    Raises:
        RuntimeError: ``source`` is incomplete (no commit marker).
    """
    src = local_path(source, "`consolidate_checkpoint`")
    dst = local_path(destination, "`consolidate_checkpoint`")
    checkpoint, rng_states, marker = read_all(src)
    checkpoint["state_dict"] = canonical_to_full(checkpoint["state_dict"])
    if "optimizer_states" in checkpoint:
        checkpoint["optimizer_states"] = [canonical_optimizer_to_full(o) for o in checkpoint["optimizer_states"]]
    checkpoint[INFO_KEY] = {
        "format": "consolidated",
        "world_size": marker.get("world_size"),
        "rng_states": rng_states,
    }
    write_file(checkpoint, dst, token=f"{os.getpid()}")
    return dst


def load_consolidated_state_dict(path: str | os.PathLike, prefix: str = "") -> dict[str, Tensor]:
    """The unsharded model state dict of a checkpoint (a consolidated file or a sharded directory).

    Args:
        path: the checkpoint.
        prefix: keep only keys starting with it, with it removed: ``"model."`` turns the keys of
            :class:`~lightning_moe_overlap.demo_hf.HFMoECausalLM` into those of the Hugging Face model it wraps.
    """
    src = local_path(path, "`load_consolidated_state_dict`")
    if src.is_dir():
        state = canonical_to_full(read_all(src)[0]["state_dict"])
    else:
        state = read_file(src)["state_dict"]
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
