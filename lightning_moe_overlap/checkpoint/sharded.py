"""The sharded format: one ``torch.distributed.checkpoint`` (DCP) directory written by every rank together.

Directory layout (``<path>/``)::

    .metadata, __<rank>_0.distcp   DCP: model and optimizer tensors, each rank's RNG state
    meta.pt                        the rest of Lightning's checkpoint (loops, schedulers, callbacks, hparams) and
                                   each optimizer's parameter groups by name, written by rank 0
    COMMIT                         written last (atomic.py): format, version, world size, ep, dp, pp, the unsplit
                                   model's state-dict keys in order

The DCP state is ``{"model": ..., "optimizer": ..., "rng": {"rank_<r>": ...}}`` (further optimizers under
``optimizer_<i>``), keyed by the unsplit model's names (:mod:`.state`)::

    model.layers.0.mlp.experts.gate_up_proj                      [E, 2F, D]  (global shape)
    optimizer.state.layers.0.mlp.experts.gate_up_proj.exp_avg    [E, 2F, D]
    optimizer.param_groups.layers.0.mlp.experts.gate_up_proj.lr

DCP stores every tensor by its global shape and each rank's part by its offset: a ``DTensor`` expert stack is
written by its ep ranks (each its own experts; expert-data-parallel replicas write one copy), a replicated plain
tensor once. A loading rank asks for the entries it holds in its own layout and DCP reads the slices it needs, so
resharding across ep, dp, FSDP2 sharding and pp comes from DCP. At pp > 1 a rank writes and reads only the tensors
it holds (never a meta one).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_moe_overlap.checkpoint import fit_checks, safe_load
from lightning_moe_overlap.checkpoint.atomic import read_marker
from lightning_moe_overlap.checkpoint.state import (
    GROUPS,
    STATE,
    absent_keys,
    expert_counts,
    global_shape,
    model_state,
    optimizer_state,
    param_of,
)

META_FILE = "meta.pt"
MODEL, RNG = "model", "rng"
VERSION = 2  # 1: per-expert keys `name[e]` (legacy.py converts it)


def optimizer_key(i: int) -> str:
    return "optimizer" if i == 0 else f"optimizer_{i}"


def _rank_key(rank: int) -> str:
    return f"rank_{rank}"


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


@contextmanager
def single_process_quiet() -> Iterator[None]:
    """DCP warns on every single-process call that it assumes one process: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        yield


def sharded_state(
    checkpoint: dict[str, Any], groups: list[Any], *, rank: int, rng: bytes
) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's DCP state of a Lightning checkpoint and ``meta.pt``'s content (rank 0 writes it).

    ``checkpoint["state_dict"]`` and each ``checkpoint["optimizer_states"][i]`` are what :mod:`.state` gives (the
    held entries); ``groups``: each optimizer's parameter groups by name (rank 0's are written).
    """
    state: dict[str, Any] = {MODEL: dict(checkpoint["state_dict"]), RNG: {_rank_key(rank): rng}}
    for i, flat in enumerate(checkpoint.get("optimizer_states", [])):
        state[optimizer_key(i)] = dict(flat)
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    if "optimizer_states" in checkpoint:
        meta["optimizer_states"] = [{"param_groups": g} for g in groups]
    return state, meta


def write_sharded(staging: Path, checkpoint: dict[str, Any], groups: list[Any], *, rank: int, rng: bytes) -> None:
    """Write this rank's part of a Lightning checkpoint into ``staging`` (collective over all ranks); see
    :func:`sharded_state` for the arguments."""
    state, meta = sharded_state(checkpoint, groups, rank=rank, rng=rng)
    with single_process_quiet():
        dcp.save(state, checkpoint_id=staging, no_dist=_no_dist())
    if rank == 0:
        with open(staging / META_FILE, "wb") as f:
            torch.save(meta, f)
            f.flush()
            os.fsync(f.fileno())


def saved_entries(path: Path, *, weights_only: bool = True) -> dict[str, Any]:
    """``{flat DCP key: global shape or None}`` of a sharded checkpoint directory."""
    metadata = safe_load.read_dcp_metadata(path, weights_only=weights_only).state_dict_metadata
    return {k: (m.size if isinstance(m, TensorStorageMetadata) else None) for k, m in metadata.items()}


def read_sharded(
    path: Path, module: nn.Module, optimizers: list[torch.optim.Optimizer], *, rank: int, same_world: bool,
    strict: bool, weights_only: bool = True,
) -> tuple[dict[str, Any], bytes | None]:
    """Read this rank's part of a committed sharded checkpoint straight into the live tensors.

    Collective: every rank calls it. The checks run before any tensor is read, and every rank raises the first
    rank's error. Returns Lightning's checkpoint (``state_dict``: the loaded model entries, ``optimizer_states``:
    flat optimizer states) and this rank's RNG state when ``same_world``. ``weights_only``: every file is read
    without running code from it (:mod:`.safe_load`).

    Raises:
        ValueError: the checkpoint does not fit the model (expert count, keys, shapes, optimizer parameters), or
            ``weights_only`` and a file needs more than plain data.
    """
    error: Exception | None = None
    request: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    try:
        meta = read_meta(path, weights_only=weights_only)
        request = _request(path, module, optimizers, meta, strict=strict, weights_only=weights_only)
    except (ValueError, NotImplementedError) as err:
        error = err
    fit_checks.agree(error)
    if same_world:
        request[RNG] = {_rank_key(rank): None}
    with single_process_quiet():
        refused = safe_load.dcp_load(request, path, weights_only=weights_only, no_dist=_no_dist())
    fit_checks.agree(refused)
    checkpoint = {k: v for k, v in meta.items() if k != "optimizer_states"}
    checkpoint["state_dict"] = request[MODEL]
    count = min(len(optimizers), len(meta.get("optimizer_states", [])))
    if count:
        checkpoint["optimizer_states"] = [request[optimizer_key(i)] for i in range(count)]
    return checkpoint, request.get(RNG, {}).get(_rank_key(rank))


def _request(
    path: Path, module: nn.Module, optimizers: list[torch.optim.Optimizer], meta: dict[str, Any], *, strict: bool,
    weights_only: bool,
) -> dict[str, Any]:
    """The entries this rank reads, each the live tensor to read into (after checking they fit the model)."""
    entries = saved_entries(path, weights_only=weights_only)
    saved = _under(entries, MODEL)
    fit_checks.check_expert_counts(saved, expert_counts(module), str(path))
    template = model_state(module)
    absent = absent_keys(module)
    relevant = {k: s for k, s in saved.items() if k not in absent}
    fit_checks.check_keys(relevant, {k: global_shape(v) for k, v in template.items()}, str(path), strict=strict)
    request: dict[str, Any] = {MODEL: {k: v for k, v in template.items() if k in saved}}
    held = {n for n, p in module.named_parameters() if not p.is_meta}
    for i, optimizer in enumerate(optimizers[: len(meta.get("optimizer_states", []))]):
        key = optimizer_key(i)
        flat_saved = _under(entries, key)
        flat = optimizer_state(module, optimizer, template=True)
        listed = {param_of(k) for k in flat if k.startswith(GROUPS)}
        fit_checks.check_optimizer({param_of(k) for k in flat_saved if k.startswith(GROUPS)}, listed, held, str(path))
        with_state = {param_of(k) for k in flat_saved if k.startswith(STATE)}
        wanted = {k: v for k, v in flat.items() if k.startswith(GROUPS) or param_of(k) in with_state}
        fit_checks.check_state_names(flat_saved, wanted, str(path))
        request[key] = wanted
    return request


def _under(entries: dict[str, Any], prefix: str) -> dict[str, Any]:
    dot = f"{prefix}."
    return {k[len(dot) :]: v for k, v in entries.items() if k.startswith(dot)}


def read_meta(path: Path, *, weights_only: bool) -> dict[str, Any]:
    """``meta.pt`` of a sharded checkpoint directory (:mod:`.safe_load` when ``weights_only``)."""
    return safe_load.load(path / META_FILE, f"the checkpoint file {path / META_FILE}", weights_only=weights_only)


def load_everything(path: Path, *, weights_only: bool) -> dict[str, Any]:
    """Every DCP entry of ``path`` in one process, no process group: ``{flat key: full tensor or value}``."""
    metadata = safe_load.read_dcp_metadata(path, weights_only=weights_only).state_dict_metadata
    flat = {k: (torch.empty(m.size, dtype=m.properties.dtype) if isinstance(m, TensorStorageMetadata) else None)
            for k, m in metadata.items()}
    with single_process_quiet():
        refused = safe_load.dcp_load(flat, path, weights_only=weights_only, no_dist=True)
    if refused is not None:
        raise refused
    return flat


def read_all(path: Path, *, weights_only: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every entry of a committed sharded checkpoint in one process, no process group (offline consolidation).

    Returns ``({"model": ..., "optimizer": ..., "rng": ...}`` with full tensors, ``meta.pt``'s content).
    """
    read_marker(path)
    flat = load_everything(path, weights_only=weights_only)
    state: dict[str, Any] = {}
    for key, value in flat.items():
        top, _, rest = key.partition(".")
        state.setdefault(top, {})[rest] = value
    return state, read_meta(path, weights_only=weights_only)


__all__ = ["META_FILE", "MODEL", "RNG", "VERSION", "load_everything", "optimizer_key", "read_all", "read_meta",
           "read_sharded", "saved_entries", "sharded_state",
           "single_process_quiet", "write_sharded"]
