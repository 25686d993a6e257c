"""A sharded checkpoint directory read in parts by several processes: each holds ``1 / world`` of every model tensor.

What an offline tool needs when the model does not fit one process (``export_checkpoint_hf``, the ``export-hf``
command under ``torchrun``): no LightningModule, no layout of the run that wrote it, only the directory. Each process
asks DCP for its rows of every tensor (a ``DTensor`` ``Shard(0)`` over all ranks), and DCP reads the stored pieces
that meet them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_moe_overlap.checkpoint import fit_checks, legacy, safe_load
from lightning_moe_overlap.checkpoint.atomic import read_marker
from lightning_moe_overlap.checkpoint.sharded import MODEL, saved_entries, single_process_quiet


def read_parts(
    path: Path, prefix: str, *, weights_only: bool, owner: str
) -> tuple[dict[str, Tensor], dict[str, tuple[int, ...]]]:
    """``(held, shapes)`` of the model tensors under ``prefix`` of a committed sharded directory, in the model's
    state-dict order (the commit marker records it), each process holding ``1 / world`` of every tensor: a
    ``DTensor`` ``Shard(0)`` over all ranks of the default group where one is initialised (0-d tensors replicated),
    whole tensors in one process otherwise. Collective where distributed.

    Raises:
        ValueError: ``path`` is no committed version-2 directory, or it holds no model key under ``prefix``.
    """
    marker = read_marker(path) if path.is_dir() else None
    if marker is None or legacy.is_legacy(marker):
        raise ValueError(
            f"{owner}: {path} is {'a file' if marker is None else 'a version-1 sharded directory'}; reading it in "
            "parts needs a sharded checkpoint directory of format version 2. Fix: export it in one process with "
            "`export_hf(load_consolidated_state_dict(path), ...)` (the `export-hf` command does), or convert it "
            "first (`convert-checkpoint`)."
        )
    saved = {k.removeprefix(f"{MODEL}."): s for k, s in saved_entries(path, weights_only=weights_only).items()
             if k.startswith(f"{MODEL}.")}  # fmt: skip
    order = {k: i for i, k in enumerate(marker.get("keys", ()))}  # the unsplit model's state-dict order
    under = sorted((k for k, s in saved.items() if s is not None and k.startswith(prefix)), key=lambda k: (
        order.get(k, len(order)), k))  # fmt: skip
    shapes = {k: tuple(saved[k]) for k in under}
    if not shapes:
        raise ValueError(
            f"{owner}: no key starts with prefix={prefix!r} among the model keys of {path} (keys: "
            f"{sorted(saved)[:3]}). Fix: pass the prefix of the HF model's attribute in the LightningModule (`model.` "
            "for `self.model`)."
        )
    metadata = safe_load.read_dcp_metadata(path, weights_only=weights_only).state_dict_metadata
    mesh = _world_mesh()
    held = {k: _part(shape, metadata[f"{MODEL}.{k}"].properties.dtype, mesh) for k, shape in shapes.items()}
    with single_process_quiet():
        refused = safe_load.dcp_load({MODEL: held}, path, weights_only=weights_only, no_dist=not _distributed())
    fit_checks.agree(refused)
    return held, shapes


def _world_mesh() -> Any:
    """A 1-D CPU mesh of every rank (None in one process)."""
    if not _distributed():
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _part(shape: tuple[int, ...], dtype: torch.dtype, mesh: Any) -> Tensor:
    """An empty tensor of ``shape``: this rank's rows of it over ``mesh``, whole without one."""
    if mesh is None:
        return torch.empty(shape, dtype=dtype)
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import empty as dtensor_empty

    placement = Shard(0) if len(shape) else Replicate()
    return dtensor_empty(shape, dtype=dtype, device_mesh=mesh, placements=[placement])


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()
