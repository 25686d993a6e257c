"""The consolidated format: one ``torch.save`` file, exactly what an unsharded single-process run would write.

``state_dict`` holds every expert in the full layout (``gate_up_proj [E, 2F, D]``) under the unsharded model's
names, and ``optimizer_states`` are plain ``optimizer.state_dict()`` dicts with ``[E, ...]`` expert state. So the
file loads into the unsharded LightningModule (``load_from_checkpoint``, ``load_state_dict``), resumes a run at any
layout (including a plain single-device Trainer), and, with the LightningModule's attribute prefix removed
(:func:`load_consolidated_state_dict`), into a Hugging Face model. ``moe_checkpoint`` records the layout that wrote
it and each rank's RNG state.

Writing gathers every key once on rank 0 (from each pp stage and ep rank, :func:`gather_full`) and rank 0 writes;
:func:`consolidate_checkpoint` converts a sharded directory offline in one process, with the same stacking. At
pp > 1 every rank reads the tensors it holds (:mod:`.held`) and checks the keys of the whole model, so a file that
lacks a key fails on every rank alike.

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
from lightning_moe_overlap.checkpoint.keys import canonical_to_full, check_keys, full_to_canonical, shapes_of, split_key
from lightning_moe_overlap.checkpoint.optimizer import (
    canonical_optimizer_to_full,
    full_optimizer_to_canonical,
    merge_param_groups,
)
from lightning_moe_overlap.checkpoint.sharded import read_all
from lightning_moe_overlap.checkpoint.target import LoadTarget
from lightning_moe_overlap.parallel import ParallelGroups

INFO_KEY = "moe_checkpoint"


# -- gather (collective) ---------------------------------------------------------------------------------------
def gather_full(
    checkpoint: dict[str, Any],
    target: LoadTarget,
    ep_group: dist.ProcessGroup | None,
    rng_state: bytes,
    *,
    groups: ParallelGroups | None = None,
) -> dict[str, Any] | None:
    """The unsharded checkpoint on global rank 0 (``None`` elsewhere) from every rank's canonical checkpoint.

    Collective over the whole world. One rank per (pp stage, ep rank) sends its experts and one rank per pp stage
    its dense tensors, each key once, to rank 0 (CPU copies, ``gather_object``); the replicas send nothing. Rank 0
    stacks them exactly as the offline :func:`consolidate_checkpoint` does, in the unsplit module's key order.

    Args:
        checkpoint: this rank's canonical checkpoint (``state_dict``, optionally ``optimizer_states``).
        target: this rank's :class:`LoadTarget`.
        ep_group: the ep group (used when ``groups`` is ``None``: then only the ep group of rank 0 sends).
        rng_state: this rank's RNG state, recorded per rank.
        groups: the run's process groups; required at pp > 1 (every pp stage sends its chunks).

    Raises:
        ValueError: this rank holds part of the model (tensors on meta) and no ``groups`` were given.
    """
    if groups is None and target.absent:
        raise ValueError(
            f"`gather_full`: {len(target.absent)} tensors of the model are on the meta device here (e.g. "
            f"{sorted(target.absent)[:3]}), so other pipeline ranks hold them, but no `groups` were given to gather "
            "them from. Rule: at pp > 1 every pipeline stage sends its chunks to rank 0. Fix: pass "
            "`groups=` the run's `ParallelGroups`."
        )
    sends_experts, sends_dense = _role(target, ep_group, groups)
    mine = {
        "rng": rng_state,
        "part": _part(checkpoint, target, experts=sends_experts, dense=sends_dense),
    }
    every = [mine]
    if _distributed():
        every = [None] * dist.get_world_size()
        dist.gather_object(mine, every if target.rank == 0 else None, dst=0)
    if target.rank != 0:
        return None
    parts = [p["part"] for p in every if p["part"] is not None]
    full = {k: v for k, v in checkpoint.items() if k != "optimizer_states"}
    state: dict[str, Any] = {}
    for part in parts:
        state.update(part["state_dict"])
    full["state_dict"] = _in_order(canonical_to_full(state), target.order)
    info: dict[str, Any] = {"format": "consolidated", "world_size": target.world_size}
    if "optimizer_states" in checkpoint:
        full["optimizer_states"], info["param_names"] = [], []
        for i in range(len(checkpoint["optimizer_states"])):
            merged = _merge_optimizer([part["optimizer_states"][i] for part in parts], target.param_order)
            full["optimizer_states"].append(canonical_optimizer_to_full(merged))
            info["param_names"].append([n for g in merged["param_groups"] for n in g["params"]])
    info["rng_states"] = [p["rng"] for p in every]
    full[INFO_KEY] = info
    return full


def _role(
    target: LoadTarget, ep_group: dist.ProcessGroup | None, groups: ParallelGroups | None
) -> tuple[bool, bool]:
    """(sends its experts, sends its dense tensors): each key reaches rank 0 from one rank."""
    if not _distributed():
        return True, True
    if groups is not None:
        c = groups.coords
        first_replica = c.edp == 0 and c.tp == 0
        return first_replica, first_replica and c.ep == 0
    ranks = dist.get_process_group_ranks(ep_group) if ep_group is not None else [0]
    return 0 in ranks, target.rank == 0


def _part(checkpoint: dict[str, Any], target: LoadTarget, *, experts: bool, dense: bool) -> dict[str, Any] | None:
    """The canonical entries this rank sends (expert ones: those of its expert-parallel tensors), on the CPU."""
    if not (experts or dense):
        return None

    def keep(key: str) -> bool:
        return experts if split_key(key)[0] in target.shards else dense

    out = {"state_dict": {k: _cpu(v) for k, v in checkpoint["state_dict"].items() if keep(k)}}
    if "optimizer_states" in checkpoint:
        out["optimizer_states"] = [
            {
                "state": {k: {n: _cpu(v) for n, v in e.items()} for k, e in optim["state"].items() if keep(k)},
                "param_groups": optim["param_groups"],
            }
            for optim in checkpoint["optimizer_states"]
        ]
    return out


def _merge_optimizer(parts: list[dict[str, Any]], order: tuple[str, ...]) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for part in parts:
        state.update(part["state"])
    return {"state": state, "param_groups": merge_param_groups([p["param_groups"] for p in parts], order)}


def _in_order(state: dict[str, Any], order: tuple[str, ...]) -> dict[str, Any]:
    """``state`` with the keys of ``order`` first, in that order (the unsplit module's ``state_dict()`` order)."""
    position = {k: i for i, k in enumerate(order)}
    return dict(sorted(state.items(), key=lambda item: position.get(item[0], len(position))))


def _cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, Tensor) else value


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


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
    info = full.get(INFO_KEY) or {}
    out = {k: v for k, v in full.items() if k not in ("state_dict", "optimizer_states")}
    state = full_to_canonical(full["state_dict"], target.shards)
    check_keys(shapes_of(state), {**target.model, **target.absent}, str(path), strict=target.strict)
    out["state_dict"] = {k: v for k, v in state.items() if k in target.model}
    if "optimizer_states" in full:
        saved_names = info.get("param_names") or [None] * len(full["optimizer_states"])
        out["optimizer_states"] = [
            full_optimizer_to_canonical(osd, names, target.shards, str(path), target.absent, saved)
            for osd, names, saved in zip(full["optimizer_states"], target.optimizers, saved_names)
        ]
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
    checkpoint["state_dict"] = _in_order(canonical_to_full(checkpoint["state_dict"]), tuple(marker.get("keys", ())))
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
        checkpoint, _, marker = read_all(src)
        state = _in_order(canonical_to_full(checkpoint["state_dict"]), tuple(marker.get("keys", ())))
    else:
        state = read_file(src)["state_dict"]
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
