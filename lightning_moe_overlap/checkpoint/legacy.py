"""Sharded checkpoints of format version 1 (lightning-moe-overlap 0.1.0): read them, convert them once.

Version 1 split each expert stack into one DCP entry per global expert (``state_dict/<name>[<e>]``), keyed the
optimizer state the same way (``optimizer_<i>/state/<name>[<e>]/exp_avg``, shared entries such as ``step`` under
``<name>``) and kept each optimizer's named ``param_groups`` in ``meta.pt``. :func:`convert_legacy_checkpoint`
stacks every expert back into ``[E, ...]`` and writes a version-2 directory (:mod:`.sharded`) in one process;
that directory then loads at any layout. ``lightning-moe-overlap convert-checkpoint SRC DST`` does the same.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from lightning_moe_overlap.checkpoint import atomic, safe_load
from lightning_moe_overlap.checkpoint.optimizer import to_indexed
from lightning_moe_overlap.checkpoint.sharded import (
    META_FILE,
    MODEL,
    RNG,
    VERSION,
    load_everything,
    optimizer_key,
    read_meta,
    single_process_quiet,
)
from lightning_moe_overlap.checkpoint.state import GROUPS, INFO_KEY, STATE, in_order

_EXPERT = re.compile(r"^(?P<name>.+)\[(?P<expert>\d+)\]$")
_MODEL, _RNG = "state_dict/", "rng/rank_"


def is_legacy(marker: dict[str, Any]) -> bool:
    return marker.get("format") == "sharded" and int(marker.get("version", 1)) == 1


def refuse(path: Path) -> None:
    """Raise the error that names the converter (a version-1 directory does not load directly)."""
    raise ValueError(
        f"the checkpoint at {path} has format version 1 (per-expert keys, written by lightning-moe-overlap 0.1.0); "
        "this version reads version 2 (the model's own names, through DCP). Convert it once, in one process: "
        f"`lightning-moe-overlap convert-checkpoint {path} NEW_PATH` or `convert_legacy_checkpoint(src, dst)` from "
        "`lightning_moe_overlap.checkpoint`, then load NEW_PATH."
    )


def _split(key: str) -> tuple[str, int | None]:
    match = _EXPERT.match(key)
    return (key, None) if match is None else (match["name"], int(match["expert"]))


def _stack(entries: dict[str, Any]) -> dict[str, Any]:
    """``name[e]`` entries stacked into ``name`` ``[E, ...]``; other entries kept, in order of first appearance."""
    out: dict[str, Any] = {}
    experts: dict[str, dict[int, Any]] = {}
    for key, value in entries.items():
        name, expert = _split(key)
        if expert is None:
            out[key] = value
        else:
            experts.setdefault(name, {})[expert] = value
            out.setdefault(name, None)
    for name, pieces in experts.items():
        if sorted(pieces) != list(range(len(pieces))):
            raise ValueError(
                f"`{name}` has experts {sorted(pieces)[:8]} in the version-1 checkpoint, not every expert 0..E-1: "
                "the checkpoint is incomplete. Convert a complete checkpoint."
            )
        out[name] = torch.stack([pieces[e] for e in range(len(pieces))])
    return out


def read_all(
    src: Path, *, weights_only: bool = True
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Every entry of a version-1 directory: (model ``[E, ...]``, ``{i: {name: state}}``, rng by rank, meta.pt)."""
    flat = load_everything(src, weights_only=weights_only)
    # version 1 pickled every value that is not a tensor, except the RNG states (bytes already)
    unpack = {
        k: (safe_load.plain_loads(v, f"the entry `{k}` of {src}", weights_only=weights_only)
            if isinstance(v, bytes) and not k.startswith(_RNG) else v)
        for k, v in flat.items()
    }
    model = _stack({k[len(_MODEL) :]: v for k, v in unpack.items() if k.startswith(_MODEL)})
    optimizers: dict[int, dict[str, dict[str, Any]]] = {}
    for key, value in unpack.items():
        match = re.match(r"^optimizer_(\d+)/state/(.+)/([^/]+)$", key)
        if match:
            optimizers.setdefault(int(match[1]), {}).setdefault(match[2], {})[match[3]] = value
    states = {}
    for i, entries in optimizers.items():
        merged: dict[str, dict[str, Any]] = {}
        experts: dict[str, dict[int, dict[str, Any]]] = {}
        for key, entry in entries.items():
            name, expert = _split(key)
            if expert is None:
                merged.setdefault(name, {}).update(entry)
            else:
                experts.setdefault(name, {})[expert] = entry
        for name, pieces in experts.items():
            for state_name in pieces[0]:
                stacked = _stack({f"{name}[{e}]": p[state_name] for e, p in pieces.items()})
                merged.setdefault(name, {})[state_name] = stacked[name]
        states[i] = merged
    rng = {int(k[len(_RNG) :]): v for k, v in unpack.items() if k.startswith(_RNG)}
    return model, states, rng, read_meta(src, weights_only=weights_only)


def read_unsharded(src: Path, *, weights_only: bool = True) -> dict[str, Any]:
    """The consolidated checkpoint dict (:mod:`.consolidated`) of a version-1 directory."""
    marker = atomic.read_marker(src)
    model, states, rng, meta = read_all(src, weights_only=weights_only)
    checkpoint = {k: v for k, v in meta.items() if k != "optimizer_states"}
    checkpoint["state_dict"] = in_order(model, list(marker.get("keys", ())))
    info: dict[str, Any] = {"format": "consolidated", "world_size": marker.get("world_size"), "param_names": []}
    if "optimizer_states" in meta:
        checkpoint["optimizer_states"] = []
        for i, saved in enumerate(meta["optimizer_states"]):
            groups = saved["param_groups"]
            checkpoint["optimizer_states"].append(to_indexed(states.get(i, {}), groups))
            info["param_names"].append([n for g in groups for n in g["params"]])
    info["rng_states"] = [rng.get(r) for r in range(int(marker.get("world_size") or 0))]
    checkpoint[INFO_KEY] = info
    return checkpoint


def _check_paths(src: Path, dst: Path) -> None:
    """Refuse a source that is a file and a destination that exists (the conversion would replace it)."""
    if src.is_file():
        raise ValueError(
            f"`convert_legacy_checkpoint`: {src} is a file, not a version-1 sharded checkpoint directory; a file is "
            "a consolidated checkpoint, which loads directly. Only version-1 directories need converting."
        )
    if dst.exists() or dst.is_symlink():
        raise ValueError(
            f"`convert_legacy_checkpoint`: the destination {dst} exists; the conversion writes a new directory and "
            "replaces nothing. Pass a path that does not exist yet, or delete it first."
        )


def convert_legacy_checkpoint(
    source: str | os.PathLike, destination: str | os.PathLike, *, weights_only: bool = True
) -> Path:
    """Convert a version-1 sharded directory into a version-2 one at ``destination`` (one process, no group).

    Needs the memory of the whole checkpoint. The result is committed atomically like any save.
    ``weights_only``: read every file without running code from it (:mod:`.safe_load`); ``False`` only for a
    checkpoint from a trusted source.

    Raises:
        FileNotFoundError: nothing at ``source``.
        RuntimeError: ``source`` is incomplete (no commit marker).
        ValueError: ``source`` is not a version-1 sharded directory, ``destination`` exists, or ``weights_only``
            and one of its files needs more than plain data.
    """
    src = atomic.local_path(source, "`convert_legacy_checkpoint`")
    dst = atomic.local_path(destination, "`convert_legacy_checkpoint`")
    _check_paths(src, dst)
    marker = atomic.read_marker(src)
    if not is_legacy(marker):
        raise ValueError(
            f"`convert_legacy_checkpoint`: {src} is not a version-1 sharded checkpoint (its COMMIT marker says "
            f"format {marker.get('format')!r}, version {marker.get('version')!r}). Only version-1 directories need "
            "converting; load this one directly."
        )
    model, states, rng, meta = read_all(src, weights_only=weights_only)
    state: dict[str, Any] = {MODEL: model, RNG: {f"rank_{r}": v for r, v in rng.items()}}
    for i, saved in enumerate(meta.get("optimizer_states", [])):
        flat: dict[str, Any] = {}
        for name, entry in states.get(i, {}).items():
            flat.update({f"{STATE}{name}.{k}": v for k, v in entry.items()})
        for group in saved["param_groups"]:
            for name in group["params"]:
                flat.update({f"{GROUPS}{name}.{k}": v for k, v in group.items() if k != "params"})
        state[optimizer_key(i)] = flat
    token = uuid.uuid4().hex[:8]
    staging = atomic.staging_path(dst, token)
    staging.mkdir(parents=True)
    with single_process_quiet():
        dcp.save(state, checkpoint_id=staging, no_dist=True)
    torch.save(meta, staging / META_FILE)
    atomic.write_marker(staging, {**marker, "version": VERSION, "converted_from": 1})
    atomic.publish(staging, dst, token)
    return dst
