"""The consolidated format: one ``torch.save`` file, exactly what an unsharded single-process run would write.

``state_dict`` holds every tensor unsharded (experts ``gate_up_proj [E, 2F, D]``) under the unsplit model's names
and ``optimizer_states`` are plain ``optimizer.state_dict()`` dicts. So the file loads into the unsharded
LightningModule (``load_from_checkpoint``), resumes a run at any layout, and, with the LightningModule's attribute
prefix removed (:func:`load_consolidated_state_dict`), into a Hugging Face model. ``moe_checkpoint`` records the
layout that wrote it, the optimizers' parameter names and each rank's RNG state.

Writing takes ``StateDictOptions(full_state_dict=True, cpu_offload=True)``: every ``DTensor`` is gathered and rank 0
keeps a CPU copy. At pp > 1 each pipeline stage gathers its chunks and one rank per stage sends them to rank 0.
:func:`consolidate_checkpoint` converts a sharded directory offline in one process. Loading gives each rank its
part of every unsharded tensor (``distribute_tensor`` of the file's value in the live tensor's layout).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_moe_overlap.checkpoint import fit_checks, safe_load
from lightning_moe_overlap.checkpoint.atomic import check_not_staging, local_path, publish, read_marker, staging_path
from lightning_moe_overlap.checkpoint.optimizer import (
    flat_to_named,
    indexed_to_flat,
    merge_param_groups,
    named_groups,
    param_names,
    to_indexed,
)
from lightning_moe_overlap.checkpoint.state import (
    GROUPS,
    INFO_KEY,
    STATE,
    absent_keys,
    expert_counts,
    full_model_state,
    full_optimizer_state,
    global_shape,
    in_order,
    like,
    model_state,
    optimizer_state,
    param_of,
)
from lightning_moe_overlap.parallel import ParallelGroups


# -- gather (collective) ---------------------------------------------------------------------------------------
def gather_full(
    checkpoint: dict[str, Any],
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    groups: ParallelGroups | None,
    rng_state: bytes,
    *,
    world_size: int,
) -> dict[str, Any] | None:
    """The unsharded checkpoint on global rank 0 (``None`` elsewhere). Collective over every rank.

    Lightning's ``checkpoint`` with ``state_dict`` replaced by the full model (in the unsplit module's key order),
    ``optimizer_states`` by plain ``optimizer.state_dict()`` dicts, and the :data:`INFO_KEY` record.

    Raises:
        ValueError: the module has tensors on meta (pp > 1) and no pipeline ``groups`` were given.
    """
    pp = groups.dims.pp if groups is not None else 1
    absent = absent_keys(module)
    if pp == 1 and absent:
        raise ValueError(
            f"`gather_full`: {len(absent)} tensors of the model are on the meta device here (e.g. "
            f"{sorted(absent)[:3]}), so other pipeline ranks hold them, but no pipeline `groups` were given to "
            "gather them from. Rule: at pp > 1 every pipeline stage sends its chunks to rank 0. Fix: pass "
            "`groups=` the run's `ParallelGroups`."
        )
    offload = pp == 1  # rank 0 then receives every tensor from the state-dict API itself
    mine = {
        "model": full_model_state(module, cpu_offload=offload),
        "optimizers": [full_optimizer_state(module, opt, cpu_offload=offload) for opt in optimizers],
        "groups": [named_groups(opt, module) for opt in optimizers],
        "rng": rng_state,
    }
    every = [mine]
    if _distributed():
        rank = dist.get_rank()
        if offload:
            sends = rank == 0
        else:
            c = groups.coords
            sends = c.dp == 0 and c.cp == 0 and c.tp == 0  # one rank per pipeline stage
        keep = sends and rank == 0  # rank 0's own part stays here, unpickled
        sent = mine if sends and not keep else {**mine, "model": None, "optimizers": [None] * len(optimizers)}
        if sends and not keep:
            sent = {**sent, "model": _cpu(sent["model"]), "optimizers": _cpu(sent["optimizers"])}
        every = [None] * dist.get_world_size()
        dist.gather_object(sent, every if rank == 0 else None, dst=0)
        if rank != 0:
            return None
        every[0] = {**every[0], "model": _cpu(mine["model"]), "optimizers": _cpu(mine["optimizers"])}
    parts = [p for p in every if p["model"] is not None]
    order = list(module.state_dict())
    model: dict[str, Any] = {}
    for p in parts:
        model.update(p["model"])
    full = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    full["state_dict"] = in_order(model, order)
    info: dict[str, Any] = {"format": "consolidated", "world_size": world_size, "rng_states": [p["rng"] for p in every]}
    if "optimizer_states" in checkpoint:
        full["optimizer_states"], info["param_names"] = [], []
        param_order = [n for n, _ in module.named_parameters()]
        for i in range(len(optimizers)):
            merged = merge_param_groups([p["groups"][i] for p in every], param_order)
            flat: dict[str, Any] = {}
            for p in parts:
                flat.update(p["optimizers"][i])
            full["optimizer_states"].append(to_indexed(flat_to_named(flat, merged), merged))
            info["param_names"].append([n for g in merged for n in g["params"]])
    full[INFO_KEY] = info
    return full


def _cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu(v) for v in value)
    return value


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


def read_file(path: Path, *, weights_only: bool = True) -> dict[str, Any]:
    """A consolidated checkpoint file, memory-mapped (only the parts a rank takes are paged in).

    Raises:
        RuntimeError: the file is truncated or no torch checkpoint.
        ValueError: ``weights_only`` and the file needs more than plain data (:mod:`.safe_load`).
    """
    check_not_staging(path)
    try:
        return safe_load.load(path, f"the checkpoint file {path}", weights_only=weights_only, mmap=True)
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError) as err:
        raise RuntimeError(
            f"`MoEOverlapStrategy`: the checkpoint file {path} cannot be read ({err}); it is truncated or not a "
            "torch checkpoint. Load a complete checkpoint: a committed sharded directory or a consolidated file."
        ) from err


def read_consolidated(
    path: Path, module: nn.Module, optimizers: list[torch.optim.Optimizer], *, rank: int, world_size: int,
    strict: bool, weights_only: bool = True,
) -> tuple[dict[str, Any], bytes | None]:
    """This rank's part of a consolidated file, in the live tensors' layouts, and its RNG state (same world size).

    Collective (every rank calls it): the checks agree across ranks.

    Raises:
        ValueError: the checkpoint does not fit the model (expert count, keys, shapes, optimizer parameters), or
            ``weights_only`` and the file needs more than plain data.
    """
    error: Exception | None = None
    out: dict[str, Any] = {}
    info: dict[str, Any] = {}
    try:
        full = read_file(path, weights_only=weights_only)
        saved = {k: global_shape(v) for k, v in full["state_dict"].items()}
        fit_checks.check_expert_counts(saved, expert_counts(module), str(path))
        template = model_state(module)
        wanted = {k: global_shape(v) for k, v in template.items()}
        fit_checks.check_keys(saved, {**wanted, **absent_keys(module)}, str(path), strict=strict)
        out = {k: v for k, v in full.items() if k not in ("state_dict", "optimizer_states")}
        out["state_dict"] = {k: like(v, full["state_dict"][k]) for k, v in template.items() if k in saved}
        info = full.get(INFO_KEY) or {}
        if optimizers and "optimizer_states" in full:
            saved_names = info.get("param_names") or [None] * len(full["optimizer_states"])
            out["optimizer_states"] = [
                _optimizer_part(osd, names, module, opt, str(path))
                for osd, names, opt in zip(full["optimizer_states"], saved_names, optimizers)
            ]
    except (ValueError, NotImplementedError) as err:
        error = err
    fit_checks.agree(error)
    rng_states = info.get("rng_states") or []
    same_world = info.get("world_size") == world_size and rank < len(rng_states)
    return out, (rng_states[rank] if same_world else None)


def _optimizer_part(
    osd: dict[str, Any], saved_names: list[str] | None, module: nn.Module, optimizer: torch.optim.Optimizer, where: str
) -> dict[str, Any]:
    """The flat state of ``optimizer`` (its held parameters, in their layout) from a plain ``state_dict()``."""
    saved = indexed_to_flat(osd, saved_names or param_names(optimizer, module), where)
    template = optimizer_state(module, optimizer, template=True)
    held = {n for n, p in module.named_parameters() if not p.is_meta}
    listed = {param_of(k) for k in template if k.startswith(GROUPS)}
    fit_checks.check_optimizer({param_of(k) for k in saved if k.startswith(GROUPS)}, listed, held, where)
    with_state = {param_of(k) for k in saved if k.startswith(STATE)}
    wanted = {k: v for k, v in template.items() if k.startswith(GROUPS) or param_of(k) in with_state}
    fit_checks.check_state_names(saved, wanted, where)
    return {k: like(v, saved[k]) for k, v in wanted.items()}


# -- offline ---------------------------------------------------------------------------------------------------
def consolidate_checkpoint(
    source: str | os.PathLike, destination: str | os.PathLike, *, weights_only: bool = True
) -> Path:
    """Convert a sharded checkpoint directory into one consolidated file, in this process (no process group).

    Reads every tensor, so it needs the memory of the whole checkpoint (model and optimizer state). A directory
    of format version 1 (per-expert keys) is read too. ``weights_only``: read every file without running code
    from it (:mod:`.safe_load`); ``False`` only for a checkpoint from a trusted source.

    Returns:
        The path of the written file.

    Raises:
        RuntimeError: ``source`` is incomplete (no commit marker).
        ValueError: ``weights_only`` and a file of ``source`` needs more than plain data.
    """
    src = local_path(source, "`consolidate_checkpoint`")
    dst = local_path(destination, "`consolidate_checkpoint`")
    write_file(read_unsharded(src, weights_only=weights_only), dst, token=f"{os.getpid()}")
    return dst


def read_unsharded(src: Path, *, weights_only: bool = True) -> dict[str, Any]:
    """The consolidated checkpoint dict of a sharded directory (any version), read in this process."""
    from lightning_moe_overlap.checkpoint import legacy
    from lightning_moe_overlap.checkpoint.sharded import MODEL, RNG, optimizer_key, read_all

    marker = read_marker(src)
    if legacy.is_legacy(marker):
        return legacy.read_unsharded(src, weights_only=weights_only)
    state, meta = read_all(src, weights_only=weights_only)
    checkpoint = {k: v for k, v in meta.items() if k != "optimizer_states"}
    checkpoint["state_dict"] = in_order(state[MODEL], list(marker.get("keys", ())))
    info: dict[str, Any] = {"format": "consolidated", "world_size": marker.get("world_size")}
    if "optimizer_states" in meta:
        checkpoint["optimizer_states"], info["param_names"] = [], []
        for i, saved in enumerate(meta["optimizer_states"]):
            groups = saved["param_groups"]
            named = flat_to_named(state.get(optimizer_key(i), {}), groups)
            checkpoint["optimizer_states"].append(to_indexed(named, groups))
            info["param_names"].append([n for g in groups for n in g["params"]])
    rng = state.get(RNG, {})
    info["rng_states"] = [rng.get(f"rank_{r}") for r in range(int(marker.get("world_size") or 0))]
    checkpoint[INFO_KEY] = info
    return checkpoint


def load_consolidated_state_dict(
    path: str | os.PathLike, prefix: str = "", *, weights_only: bool = True
) -> dict[str, Tensor]:
    """The unsharded model state dict of a checkpoint (a consolidated file or a sharded directory).

    Args:
        path: the checkpoint.
        prefix: keep only keys starting with it, with it removed: ``"model."`` turns the keys of
            :class:`~lightning_moe_overlap.demo_hf.HFMoECausalLM` into those of the Hugging Face model it wraps.
        weights_only: read every file without running code from it (:mod:`.safe_load`); ``False`` only for a
            checkpoint from a trusted source.
    """
    src = local_path(path, "`load_consolidated_state_dict`")
    if src.is_dir():
        state = read_unsharded(src, weights_only=weights_only)["state_dict"]
    else:
        state = read_file(src, weights_only=weights_only)["state_dict"]
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def check_destination(destination: Path, *, overwrite: bool) -> None:
    """Refuse to replace what is at ``destination`` unless ``overwrite`` (and a directory always)."""
    if destination.is_dir():
        raise ValueError(
            f"`consolidate-checkpoint`: the destination {destination} is a directory; the consolidated checkpoint is "
            f"one file. Pass a file path, e.g. {destination}/consolidated.ckpt."
        )
    if destination.exists() and not overwrite:
        raise ValueError(
            f"`consolidate-checkpoint`: the destination {destination} exists; writing would replace it. Pass "
            "--overwrite to replace it, or choose another path."
        )
