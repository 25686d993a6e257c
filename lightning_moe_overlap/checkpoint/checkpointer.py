"""What ``MoEOverlapStrategy``'s checkpoint hooks do: state through torch's state-dict API, DCP, atomic commit.

Lightning builds the checkpoint dict on every rank from ``lightning_module_state_dict`` and ``optimizer_state``
(here :func:`~.state.model_state` / :func:`~.state.optimizer_state`: the held tensors, keyed by the unsplit
model's names, in the run's layout), then calls ``save_checkpoint`` on every rank. Loading reverses it:
``load_checkpoint`` reads this rank's part of either format into tensors of the live layout (after setup), then
``load_model_state_dict`` / ``load_optimizer_state_dict`` hand them to ``set_model_state_dict`` /
``set_optimizer_state_dict``.

At pp > 1 the module is the unsplit model with the other pp ranks' chunks on meta: every function here saves and
loads the tensors this rank holds only, so a checkpoint loads at any pp.
"""

from __future__ import annotations

import os
import uuid
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_moe_overlap.checkpoint import atomic, fit_checks, legacy, safe_load, state
from lightning_moe_overlap.checkpoint.background import BackgroundSaves, Commit, serialise
from lightning_moe_overlap.checkpoint.consolidated import gather_full, read_consolidated, write_file
from lightning_moe_overlap.checkpoint.optimizer import merge_param_groups, named_groups
from lightning_moe_overlap.checkpoint.rng_state import capture_rng, read_rng, restore_rng
from lightning_moe_overlap.checkpoint.sharded import VERSION, read_sharded, sharded_state, write_sharded
from lightning_moe_overlap.config import CHECKPOINT_FORMATS, CheckpointFormat
from lightning_moe_overlap.parallel import ParallelGroups

FORMATS = CHECKPOINT_FORMATS
_OWNER = "`MoEOverlapStrategy`"


def check_format(checkpoint_format: Any) -> CheckpointFormat:
    if checkpoint_format not in FORMATS:
        raise ValueError(
            f"{_OWNER}: `checkpoint_format={checkpoint_format!r}` is not one of {list(FORMATS)}. Use 'sharded' "
            "(each rank writes its part; the default) or 'consolidated' (one file with the full experts)."
        )
    return checkpoint_format


module_state = state.model_state


def optimizer_state(optimizer: torch.optim.Optimizer, module: nn.Module) -> dict[str, Any]:
    """The flat optimizer state of the held parameters (:mod:`.state`)."""
    return state.optimizer_state(module, optimizer)


def save(
    checkpoint: dict[str, Any],
    path: str | os.PathLike,
    checkpoint_format: str,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    groups: ParallelGroups | None,
    background: BackgroundSaves | None = None,
) -> None:
    """Write a checkpoint (every rank calls it): sharded directory or consolidated file, committed last.

    ``groups``: the run's process groups (``None`` for a single process); at pp > 1 they are required.
    ``background``: write a sharded checkpoint in the background (:mod:`.background`): this returns once this
    rank's tensors are copied to host memory, and the checkpoint appears under its name when every rank's files
    are written. ``None`` (and every consolidated save) writes before returning.
    """
    fmt = check_format(checkpoint_format)
    if background is not None:
        background.wait()  # at most one in flight
    final, token = _broadcast((atomic.local_path(path, f"{_OWNER}.save_checkpoint"), uuid.uuid4().hex[:8]))
    rank, world_size = _rank_world()
    rng_state = capture_rng()
    if fmt == "consolidated":
        full = gather_full(checkpoint, module, optimizers, groups, rng_state, world_size=world_size)
        if full is not None:
            write_file(full, final, token)
            _remove_leftovers(final, token)
        _barrier()
        return
    named = _merged_groups(optimizers, module, rank) if "optimizer_states" in checkpoint else []
    staging = atomic.staging_path(final, token)
    if rank == 0:
        staging.mkdir(parents=True)
    _barrier()
    if background is not None:
        state, meta = sharded_state(checkpoint, named, rank=rank, rng=rng_state)
        commit = None
        if rank == 0:
            finish = partial(_commit, staging, final, token, _marker(module, world_size, groups))
            commit = Commit(staging, serialise(meta), finish)
        background.start(state, staging, commit)
        return
    write_sharded(staging, checkpoint, named, rank=rank, rng=rng_state)
    _barrier()  # every rank's files are on disk before the commit
    if rank == 0:
        _commit(staging, final, token, _marker(module, world_size, groups))
    _barrier()


def _commit(staging: Path, final: Path, token: str, marker: dict[str, Any]) -> None:
    """The coordinator, once every rank's files are in ``staging``: mark it complete, publish it as ``final``."""
    atomic.write_marker(staging, marker)
    atomic.publish(staging, final, token)
    _remove_leftovers(final, token)


def load(
    path: str | os.PathLike,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    *,
    strict: bool = True,
    restore_rng_state: bool = False,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """This rank's part of a checkpoint in the live layout (every rank calls it); restores this rank's RNG state.

    A sharded checkpoint is read straight into the live parameters and optimizer state. ``weights_only`` (``None``
    means ``True``, as in ``torch.load``): every file is read without running code from it (:mod:`.safe_load`);
    ``False`` unpickles them without restriction, for checkpoints from a trusted source only.

    Raises:
        FileNotFoundError: nothing at ``path``.
        RuntimeError: an incomplete checkpoint (no commit marker, staging name, truncated file).
        ValueError: a checkpoint that does not fit the model (the message says which rule and how to fix it), a
            version-1 directory (the message names the converter), or, with ``weights_only``, a file that needs
            more than plain data (the message names the file and the opt-out).
    """
    src = atomic.local_path(path, f"{_OWNER}.load_checkpoint")
    if src.is_symlink() and not src.exists():
        raise FileNotFoundError(
            f"{_OWNER}.load_checkpoint: {src} links to {os.readlink(src)}, which does not exist: the save it links to "
            "was not committed (`ModelCheckpoint(save_last='link')` links as the save starts; a run killed before "
            f"its background save was committed leaves the link). Resume from an earlier checkpoint in {src.parent}."
        )
    ignored_leftovers(src)
    safe = safe_load.resolve(weights_only)
    rank, world_size = _rank_world()
    optimizers = [state.unwrapped(o) for o in optimizers]
    if src.is_dir():
        marker = atomic.read_marker(src)
        if legacy.is_legacy(marker):
            legacy.refuse(src)
        same_world = marker.get("world_size") == world_size
        checkpoint, rng_state = read_sharded(
            src, module, optimizers, rank=rank, same_world=same_world, strict=strict, weights_only=safe
        )
    elif src.exists():
        checkpoint, rng_state = read_consolidated(
            src, module, optimizers, rank=rank, world_size=world_size, strict=strict, weights_only=safe
        )
    else:
        raise FileNotFoundError(f"{_OWNER}.load_checkpoint: no checkpoint at {src}. Check the path.")
    if restore_rng_state:
        _restore_rng(rng_state, f"the RNG state of rank {rank} in {src}", weights_only=safe)
    return checkpoint


def _remove_leftovers(final: os.PathLike, token: str) -> None:
    """The coordinator, once ``final`` is committed: remove what interrupted saves of the same checkpoint left."""
    path = atomic.local_path(final, _OWNER)
    found = atomic.leftovers(path.parent, path.name, keep=token)
    for path in found:
        atomic.remove(path)
    if found:
        rank_zero_info(
            f"{_OWNER}: removed {len(found)} partial checkpoint(s) an interrupted save left: "
            f"{[p.name for p in found]}."
        )


def ignored_leftovers(path: os.PathLike) -> None:
    """Log the partial checkpoints next to ``path`` (a checkpoint being loaded): interrupted saves, never loaded."""
    src = atomic.local_path(path, _OWNER)
    found = atomic.leftovers(src.parent)
    if found:
        rank_zero_info(
            f"{_OWNER}: ignored {len(found)} partial checkpoint(s) in {src.parent} that interrupted saves left "
            f"(never loaded; removed when the same checkpoint is saved again): {[p.name for p in found][:5]}."
        )


def _restore_rng(blob: bytes | None, where: str, *, weights_only: bool) -> None:
    """Restore this rank's generators from ``blob`` (if any); every rank raises the first refusal (collective)."""
    states, error = None, None
    try:
        states = None if blob is None else read_rng(blob, where, weights_only=weights_only)
    except ValueError as err:
        error = err
    fit_checks.agree(error)
    if states is not None:
        restore_rng(states)


def load_module_state(module: nn.Module, checkpoint: dict[str, Any], *, strict: bool) -> None:
    """Load ``checkpoint["state_dict"]`` (from :func:`load`) into ``module``; tensors on meta stay as they are."""
    state.load_model(module, checkpoint["state_dict"], strict=strict)


def load_optimizer_states(
    optimizers: list[torch.optim.Optimizer], module: nn.Module, checkpoint: dict[str, Any]
) -> None:
    """Load ``checkpoint["optimizer_states"]`` (flat, from :func:`load`) into the live optimizers."""
    for optimizer, flat in zip(optimizers, checkpoint["optimizer_states"]):
        listed = {state.param_of(k) for k in flat if k.startswith(state.GROUPS)}
        stateful = {state.param_of(k) for k in flat if k.startswith(state.STATE)}
        state.load_optimizer(module, optimizer, flat, no_state=listed - stateful)


def full_model_state(module: nn.Module, groups: ParallelGroups | None) -> dict[str, Any] | None:
    """The unsharded module state on global rank 0 (``None`` elsewhere); collective."""
    full = gather_full({}, module, [], groups, b"", world_size=_rank_world()[1])
    return None if full is None else full["state_dict"]


def remove(path: str | os.PathLike, rank: int) -> None:
    """Delete a checkpoint file or directory (rank 0)."""
    if rank == 0:
        atomic.remove(atomic.local_path(path, f"{_OWNER}.remove_checkpoint"))


def _merged_groups(optimizers: list[torch.optim.Optimizer], module: nn.Module, rank: int) -> list[Any]:
    """Each optimizer's named groups over every parameter of the unsplit model, on rank 0 (collective).

    At pp > 1 a rank's optimizer may list only the parameters it holds: rank 0 merges every rank's groups.
    """
    mine = [named_groups(o, module) for o in optimizers]
    if not _distributed():
        return mine
    every: list[Any] = [None] * dist.get_world_size()
    dist.gather_object(mine, every if rank == 0 else None, dst=0)
    if rank != 0:
        return mine
    order = [n for n, _ in module.named_parameters()]
    return [merge_param_groups([groups[i] for groups in every], order) for i in range(len(mine))]


def _marker(module: nn.Module, world_size: int, groups: ParallelGroups | None) -> dict[str, Any]:
    dims = groups.dims if groups is not None else None
    return {
        "format": "sharded",
        "version": VERSION,
        "world_size": world_size,
        "ep": dims.ep if dims is not None else 1,
        "dp": dims.dp if dims is not None else 1,
        "pp": dims.pp if dims is not None else 1,
        "keys": list(module.state_dict()),  # the unsplit model's keys in order (consolidation follows it)
    }


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)


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
