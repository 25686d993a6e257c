"""What ``MoEOverlapStrategy``'s checkpoint hooks do: layout-free state, the chosen format, atomic commit.

Lightning builds the checkpoint dict on every rank from ``lightning_module_state_dict`` and ``optimizer_state``
(here in the canonical form of :mod:`.keys` / :mod:`.optimizer`: this rank's experts under global keys), then calls
``save_checkpoint`` on every rank. Loading reverses it: ``load_checkpoint`` reads this rank's part of either format
in canonical form (after setup, so the experts this rank now holds are known), then ``load_model_state_dict`` /
``load_optimizer_state_dict`` stack it back into the local layout.

At pp > 1 the module is the unsplit model with the other pp ranks' chunks on meta (:mod:`.held`): every function
here saves and loads the tensors this rank holds only, under the unsplit model's names, so a checkpoint loads at
any pp. ``save`` and :func:`~.consolidated.gather_full` need the run's ``ParallelGroups`` to merge what the pp
ranks hold.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import nn

from lightning_moe_overlap.checkpoint import atomic
from lightning_moe_overlap.checkpoint.consolidated import gather_full, read_consolidated, write_file
from lightning_moe_overlap.checkpoint.held import absent, absent_params, held, is_absent
from lightning_moe_overlap.checkpoint.keys import expert_shards, from_canonical, saved_expert_counts, to_canonical
from lightning_moe_overlap.checkpoint.optimizer import (
    merge_param_groups,
    optimizer_from_canonical,
    optimizer_to_canonical,
    param_names,
)
from lightning_moe_overlap.checkpoint.rng import capture_rng, restore_rng
from lightning_moe_overlap.checkpoint.sharded import MODEL, read_sharded, write_sharded
from lightning_moe_overlap.checkpoint.target import LoadTarget
from lightning_moe_overlap.config import CHECKPOINT_FORMATS, CheckpointFormat
from lightning_moe_overlap.parallel import ParallelGroups
from lightning_moe_overlap.parallel.dtensors import like, local

FORMATS = CHECKPOINT_FORMATS
FORMAT_VERSION = 1  # pp > 1 writes the same keys: a version-1 reader reads them
_OWNER = "`MoEOverlapStrategy`"


def check_format(checkpoint_format: Any) -> CheckpointFormat:
    if checkpoint_format not in FORMATS:
        raise ValueError(
            f"{_OWNER}: `checkpoint_format={checkpoint_format!r}` is not one of {list(FORMATS)}. Use 'sharded' "
            "(each rank writes its part; the default) or 'consolidated' (one file with the full experts)."
        )
    return checkpoint_format


def _unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer itself, also when Lightning hands over its ``LightningOptimizer`` wrapper."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def local_state_dict(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` with every ``DTensor`` as the shard this rank holds."""
    return {k: local(v) if isinstance(v, torch.Tensor) else v for k, v in module.state_dict().items()}


def module_state(module: nn.Module) -> dict[str, Any]:
    """The module's state dict with this rank's experts under global per-expert keys (held tensors only)."""
    return to_canonical(held(local_state_dict(module)), expert_shards(module))


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _map_optimizer_state(
    state_dict: dict[str, Any], params: list[torch.Tensor], fn: Any
) -> dict[str, Any]:
    """``state_dict`` with ``fn(param, value)`` applied to every per-parameter state tensor (index ``i`` is
    ``params[i]``, torch's numbering)."""
    state = {
        i: {k: fn(params[i], v) if isinstance(v, torch.Tensor) and i < len(params) else v for k, v in entry.items()}
        for i, entry in state_dict["state"].items()
    }
    return {**state_dict, "state": state}


def optimizer_state(optimizer: torch.optim.Optimizer, module: nn.Module) -> dict[str, Any]:
    """The optimizer's state dict keyed by parameter name, this rank's experts under global per-expert keys."""
    optimizer = _unwrapped(optimizer)
    names = param_names(optimizer, module)
    plain = _map_optimizer_state(optimizer.state_dict(), _optimizer_params(optimizer), lambda p, v: local(v))
    return optimizer_to_canonical(plain, names, expert_shards(module), absent_params(module))


def _like_params(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A loaded state tensor in the form of its parameter (a ``DTensor`` like it when it has the local shape)."""
    return like(param, value) if value.shape == local(param).shape and value.dim() > 0 else value


def save(
    checkpoint: dict[str, Any],
    path: str | os.PathLike,
    checkpoint_format: str,
    target: LoadTarget,
    groups: ParallelGroups | None,
) -> None:
    """Write a canonical checkpoint (every rank calls it): sharded directory or consolidated file, committed last.

    ``groups``: the run's process groups (``None`` for a single process); at pp > 1 they are required.
    """
    fmt = check_format(checkpoint_format)
    final, token = _broadcast((atomic.local_path(path, f"{_OWNER}.save_checkpoint"), uuid.uuid4().hex[:8]))
    rng_state = capture_rng()
    if fmt == "consolidated":
        full = gather_full(checkpoint, target, groups.ep if groups is not None else None, rng_state, groups=groups)
        if full is not None:
            write_file(full, final, token)
        _barrier()
        return
    if groups is not None and groups.dims.pp > 1:
        checkpoint = _with_merged_groups(checkpoint, target)
    staging = atomic.staging_path(final, token)
    if target.rank == 0:
        staging.mkdir(parents=True)
    _barrier()
    write_sharded(staging, checkpoint, rank=target.rank, rng_state=rng_state)
    _barrier()  # every rank's files are on disk before the commit
    if target.rank == 0:
        atomic.write_marker(staging, _marker(staging, target, groups))
        atomic.publish(staging, final, token)
    _barrier()


def load(path: str | os.PathLike, target: LoadTarget, *, restore_rng_state: bool) -> dict[str, Any]:
    """This rank's part of a checkpoint in canonical form (every rank calls it); restores this rank's RNG state.

    Raises:
        FileNotFoundError: nothing at ``path``.
        RuntimeError: an incomplete checkpoint (no commit marker, staging name, truncated file).
        ValueError: a checkpoint that does not fit the model (the message says which rule and how to fix it).
    """
    src = atomic.local_path(path, f"{_OWNER}.load_checkpoint")
    if src.is_dir():
        checkpoint, rng_state = read_sharded(src, target)
    elif src.exists():
        checkpoint, rng_state = read_consolidated(src, target)
    else:
        raise FileNotFoundError(f"{_OWNER}.load_checkpoint: no checkpoint at {src}. Check the path.")
    if restore_rng_state and rng_state is not None:
        restore_rng(rng_state)
    return checkpoint


def load_module_state(module: nn.Module, checkpoint: dict[str, Any], *, strict: bool) -> None:
    """Stack this rank's experts of a canonical ``checkpoint["state_dict"]`` and load it into ``module``.

    Tensors on meta (other pp ranks' chunks) are left as they are; ``strict`` concerns the held ones.

    Raises:
        RuntimeError: ``strict`` and a held tensor is not in the state, or the state has a key the module lacks.
    """
    current = module.state_dict()
    missing_here = absent(current)
    state = {k: v for k, v in checkpoint["state_dict"].items() if not is_absent(k, missing_here)}
    shards = from_canonical(state, expert_shards(module))
    shards = {k: like(current[k], v) if k in current and isinstance(v, torch.Tensor) else v for k, v in shards.items()}
    if not missing_here:
        module.load_state_dict(shards, strict=strict)
        return
    result = module.load_state_dict(shards, strict=False)
    missing = [k for k in result.missing_keys if k not in missing_here]
    if strict and (missing or result.unexpected_keys):
        raise RuntimeError(
            f"{_OWNER}: the checkpoint's state does not fit the tensors this rank holds: {len(missing)} are not in "
            f"it {missing[:5]}, {len(result.unexpected_keys)} of its keys are not in the model "
            f"{result.unexpected_keys[:5]} (tensors on meta, held by other pipeline ranks, are not compared). "
            "Load a checkpoint of this model, or set `strict_loading = False` on the LightningModule."
        )


def load_optimizer_states(
    optimizers: list[torch.optim.Optimizer], module: nn.Module, checkpoint: dict[str, Any]
) -> None:
    """Load canonical ``checkpoint["optimizer_states"]`` into the live optimizers (this rank's experts)."""
    shards, missing_here = expert_shards(module), absent_params(module)
    for optimizer, state in zip(optimizers, checkpoint["optimizer_states"]):
        optimizer = _unwrapped(optimizer)
        names = param_names(optimizer, module)
        plain = optimizer_from_canonical(state, names, shards, "the checkpoint", missing_here)
        optimizer.load_state_dict(_map_optimizer_state(plain, _optimizer_params(optimizer), _like_params))


def remove(path: str | os.PathLike, rank: int) -> None:
    """Delete a checkpoint file or directory (rank 0)."""
    if rank == 0:
        atomic.remove(atomic.local_path(path, f"{_OWNER}.remove_checkpoint"))


def _with_merged_groups(checkpoint: dict[str, Any], target: LoadTarget) -> dict[str, Any]:
    """``checkpoint`` with each optimizer's ``param_groups`` naming every parameter of the unsplit model.

    Collective (gathers every rank's groups on rank 0, which writes them): at pp > 1 a rank's optimizer may list
    only the parameters it holds.
    """
    if "optimizer_states" not in checkpoint or not _distributed():
        return checkpoint
    mine = [optim["param_groups"] for optim in checkpoint["optimizer_states"]]
    every: list[Any] = [None] * dist.get_world_size()
    dist.gather_object(mine, every if target.rank == 0 else None, dst=0)
    if target.rank != 0:
        return checkpoint
    merged = [
        {**optim, "param_groups": merge_param_groups([groups[i] for groups in every], target.param_order)}
        for i, optim in enumerate(checkpoint["optimizer_states"])
    ]
    return {**checkpoint, "optimizer_states": merged}


def _marker(staging: os.PathLike, target: LoadTarget, groups: ParallelGroups | None) -> dict[str, Any]:
    """What the commit marker records; the expert counts come from the keys every rank wrote (any pp)."""
    keys = dcp.FileSystemReader(staging).read_metadata().state_dict_metadata
    model = [k[len(MODEL) :] for k in keys if k.startswith(MODEL)]
    experts = {name.rsplit(".", 1)[0]: count for name, count in saved_expert_counts(model).items()}
    dims = groups.dims if groups is not None else None
    return {
        "format": "sharded",
        "version": FORMAT_VERSION,
        "world_size": target.world_size,
        "ep": dims.ep if dims is not None else 1,
        "dp": dims.dp if dims is not None else 1,
        "pp": dims.pp if dims is not None else 1,
        "experts": experts,
        "keys": list(target.order),  # the unsplit model's state-dict keys, in its order (consolidation follows it)
    }


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _broadcast(obj: Any) -> Any:
    if not _distributed():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _barrier() -> None:
    if not _distributed():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()

