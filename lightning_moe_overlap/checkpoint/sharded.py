"""The sharded format: one ``torch.distributed.checkpoint`` (DCP) directory written by every rank together.

Directory layout (``<path>/``)::

    .metadata, __<rank>_0.distcp   DCP: model and optimizer tensors, each rank's RNG state
    meta.pt                        the rest of Lightning's checkpoint (loops, schedulers, callbacks, hparams,
                                   optimizer param_groups), written by the coordinator
    COMMIT                         written last (atomic.py): format, world size, ep, dp, pp, experts per module,
                                   the unsplit model's state-dict keys in order

DCP keys are flat strings: ``state_dict/<key>``, ``optimizer_<i>/state/<key>/<state name>`` and ``rng/rank_<r>``,
where ``<key>`` is canonical (keys.py): ``name[e]`` for expert ``e``. DCP keeps one copy of a key written by
several ranks and spreads those copies over the ranks, so each rank writes its own experts (shared with its
expert-data-parallel replicas only) and a share of the dense tensors; nothing is gathered. At pp > 1 a rank writes
only the tensors it holds (:mod:`.held`; never a meta one), so the dense keys of a chunk are shared out among the
ranks of its pp stage, and the DCP metadata lists every key of the unsplit model. A loading rank asks DCP for the
keys it holds in the new layout (any pp, ep, dp), so resharding is key selection.

Every value that is not a tensor is stored pickled, so DCP never flattens it into more keys.
"""

from __future__ import annotations

import os
import pickle
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_moe_overlap.checkpoint.atomic import read_marker
from lightning_moe_overlap.checkpoint.held import is_absent
from lightning_moe_overlap.checkpoint.keys import (
    check_expert_counts,
    check_keys,
    expert_key,
    saved_expert_counts,
    split_key,
)
from lightning_moe_overlap.checkpoint.optimizer import check_groups
from lightning_moe_overlap.checkpoint.target import LoadTarget

META_FILE = "meta.pt"
MODEL = "state_dict/"


def _optim(i: int) -> str:
    return f"optimizer_{i}/state/"


def _rng(rank: int) -> str:
    return f"rng/rank_{rank}"


def _pack(value: Any) -> Any:
    return value.detach() if isinstance(value, Tensor) else pickle.dumps(value)


def _unpack(value: Any) -> Any:
    return pickle.loads(value) if isinstance(value, bytes) else value


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


@contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every single-process call that it assumes one process: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        yield


def write_sharded(staging: Path, checkpoint: dict[str, Any], *, rank: int, rng_state: bytes) -> None:
    """Write this rank's part of a canonical Lightning checkpoint into ``staging`` (collective over all ranks).

    ``checkpoint["state_dict"]`` and each ``checkpoint["optimizer_states"][i]`` must be in the canonical form.
    """
    flat: dict[str, Any] = {f"{MODEL}{k}": _pack(v) for k, v in checkpoint["state_dict"].items()}
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    if "optimizer_states" in checkpoint:
        meta["optimizer_states"] = []
        for i, optim in enumerate(checkpoint["optimizer_states"]):
            for key, entry in optim["state"].items():
                flat.update({f"{_optim(i)}{key}/{name}": _pack(v) for name, v in entry.items()})
            meta["optimizer_states"].append({"param_groups": optim["param_groups"]})
    flat[_rng(rank)] = rng_state
    with _single_process_quiet():
        dcp.save(flat, checkpoint_id=staging, no_dist=_no_dist())
    if rank == 0:
        with open(staging / META_FILE, "wb") as f:
            torch.save(meta, f)
            f.flush()
            os.fsync(f.fileno())


def read_sharded(path: Path, target: LoadTarget) -> tuple[dict[str, Any], bytes | None]:
    """This rank's part of a committed sharded checkpoint, in canonical form, and its RNG state (same world size).

    Collective: every rank calls it. The checks run before any tensor is read and every rank raises the first
    rank's error, so a mismatch never leaves ranks waiting for each other.

    Raises:
        RuntimeError: the directory has no commit marker (an interrupted save).
        ValueError: the checkpoint does not fit the model (expert count, keys, shapes, optimizer parameters).
    """
    marker = read_marker(path)
    reader = dcp.FileSystemReader(path)
    metadata = reader.read_metadata().state_dict_metadata
    error: Exception | None = None
    request: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    try:
        meta = torch.load(path / META_FILE, map_location="cpu", weights_only=False)
        request = _request(path, metadata, meta, target, same_world=marker.get("world_size") == target.world_size)
    except (ValueError, NotImplementedError) as err:
        error = err
    _agree(error)
    with _single_process_quiet():
        dcp.load(request, storage_reader=reader, no_dist=_no_dist())
    checkpoint = _assemble(meta, request)
    return checkpoint, request.get(_rng(target.rank))


def read_all(path: Path) -> tuple[dict[str, Any], list[bytes | None], dict[str, Any]]:
    """Every key of a committed sharded checkpoint in one process (offline consolidation; no process group).

    Returns the canonical Lightning checkpoint (all experts), each saved rank's RNG state, and the commit marker.
    """
    marker = read_marker(path)
    reader = dcp.FileSystemReader(path)
    metadata = reader.read_metadata().state_dict_metadata
    request = {k: _template(m) for k, m in metadata.items()}
    with _single_process_quiet():
        dcp.load(request, storage_reader=reader, no_dist=True)
    meta = torch.load(path / META_FILE, map_location="cpu", weights_only=False)
    checkpoint = _assemble(meta, request)
    rng = [request.get(_rng(r)) for r in range(int(marker.get("world_size", 0)))]
    return checkpoint, rng, marker


def _assemble(meta: dict[str, Any], loaded: dict[str, Any]) -> dict[str, Any]:
    """The canonical Lightning checkpoint from ``meta.pt`` and the flat DCP keys that were read."""
    checkpoint = {k: v for k, v in meta.items() if k != "optimizer_states"}
    checkpoint["state_dict"] = {k[len(MODEL) :]: _unpack(v) for k, v in loaded.items() if k.startswith(MODEL)}
    if "optimizer_states" in meta:
        checkpoint["optimizer_states"] = []
        for i, saved in enumerate(meta["optimizer_states"]):
            prefix, state = _optim(i), {}
            for k, v in loaded.items():
                if k.startswith(prefix):
                    key, _, name = k[len(prefix) :].rpartition("/")
                    state.setdefault(key, {})[name] = _unpack(v)
            checkpoint["optimizer_states"].append({"state": state, "param_groups": saved["param_groups"]})
    return checkpoint


def _request(
    path: Path, metadata: dict[str, Any], meta: dict[str, Any], target: LoadTarget, *, same_world: bool
) -> dict[str, Any]:
    """The DCP keys this rank needs, each with a buffer to read into (after checking they fit the model)."""
    saved = {k[len(MODEL) :]: _shape(m) for k, m in metadata.items() if k.startswith(MODEL)}
    check_expert_counts(saved_expert_counts(saved), target.shards, str(path))
    relevant = {k: s for k, s in saved.items() if not (_other_rank_expert(k, target) or is_absent(k, target.absent))}
    check_keys(relevant, target.model, str(path), strict=target.strict)
    request = {f"{MODEL}{k}": _template(metadata[f"{MODEL}{k}"]) for k in target.model if k in saved}
    saved_optims = meta.get("optimizer_states", [])
    for i, names in enumerate(target.optimizers[: len(saved_optims)]):
        check_groups(saved_optims[i]["param_groups"], names, str(path), target.absent)
        wanted = set(names) - set(target.absent)
        for name, shard in target.shards.items():
            if name in wanted:
                wanted.update(expert_key(name, e) for e in shard.global_range)
        prefix = _optim(i)
        for k, m in metadata.items():
            if k.startswith(prefix) and k[len(prefix) :].rpartition("/")[0] in wanted:
                request[k] = _template(m)
    if same_world and _rng(target.rank) in metadata:
        request[_rng(target.rank)] = None
    return request


def _other_rank_expert(key: str, target: LoadTarget) -> bool:
    name, expert = split_key(key)
    return expert is not None and name in target.shards and key not in target.model


def _shape(m: Any) -> torch.Size | None:
    return m.size if isinstance(m, TensorStorageMetadata) else None


def _template(m: Any) -> Any:
    if isinstance(m, TensorStorageMetadata):
        return torch.empty(m.size, dtype=m.properties.dtype)
    return None


def _agree(error: Exception | None) -> None:
    """Raise the first rank's error on every rank (or nothing when no rank has one)."""
    if _no_dist():
        if error is not None:
            raise error
        return
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if error is None else (type(error), str(error)))
    for rank, found in enumerate(errors):
        if found is not None:
            kind, message = found
            if error is not None:
                raise error
            raise kind(f"{message} (raised on rank {rank})")
