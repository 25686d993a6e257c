"""Export to the Hub's layout from the tensors each rank holds, with no rank holding the model whole.

:func:`export_hf_sharded` is :func:`~.export.export_hf` for a sharded model (a live run, or a checkpoint read in
parts by several processes), in three phases, collective over the default process group where one is initialised:

1. **Plan** (no tensor data moved): the file keys and their files from the model's global shapes (the same cut by the
   key family and the same ``max_shard_bytes`` split as :func:`~.export.export_hf`, so the two write the same
   folder), each rank's boxes of them (:class:`~.save_planner.PieceSavePlanner`); a tensor no rank holds fails here
   on every rank, before anything is written.
2. **Write**, file by file, through ``torch.distributed.checkpoint.save`` with DCP's ``HuggingFaceStorageWriter``
   (``save_distributed=True``): each rank writes its boxes of the file's keys to its own safetensors parts
   (``.export-parts/<file>/``, at most ``max_shard_bytes / 4`` of keys per part), one box of a replicated tensor by
   one of its holders; the coordinator refuses a key the boxes do not cover exactly.
3. **Join**: each rank joins some of the files from their parts (torch's consolidation, one tensor in memory at a
   time, only that file's parts opened); rank 0 removes the parts and writes the index and ``config.json``.

Peak host memory on a rank: the tensors it holds, plus about three times one part (its copies of the boxes, the
per-tensor bytes and the whole part that safetensors serialises: at most ``0.75 * max_shard_bytes``), plus one whole
tensor while joining. The folder must be on a file system every rank sees (the parts of all ranks are read back).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint import save as dcp_save

from lightning_moe_overlap._compat import torch as torch_compat
from lightning_moe_overlap.checkpoint.fit_checks import agree
from lightning_moe_overlap.hf.config_match import check_keys_fit_config
from lightning_moe_overlap.hf.export import (
    CONFIG,
    DEFAULT_SHARD,
    INDEX,
    PARTS,
    check_destination,
    clear,
    generation_text,
    parse_size,
    written_config,
)
from lightning_moe_overlap.hf.families import select_family
from lightning_moe_overlap.hf.file_layout import file_entries, file_names, file_shards
from lightning_moe_overlap.hf.files import GENERATION_CONFIG
from lightning_moe_overlap.hf.keys import HFFamily, Piece
from lightning_moe_overlap.hf.planner import Chunk, chunk_of
from lightning_moe_overlap.hf.save_planner import PieceSavePlanner

OWNER = "`export_hf_sharded`"
PART_FRACTION = 4  # a rank's part file holds at most max_shard_bytes / 4 of file keys: its write's memory bound


@dataclass(frozen=True)
class ExportReport:
    """What one rank wrote.

    Attributes:
        folder: the exported folder.
        files: the folder's safetensors files (every rank's, sorted).
        keys: file keys in the folder.
        bytes_written: bytes of the boxes this rank wrote (its share after replicas' copies were dropped).
        seconds: wall time of the whole export on this rank.
    """

    folder: Path
    files: tuple[str, ...]
    keys: int
    bytes_written: int
    seconds: float

    def describe(self) -> str:
        """One line for the log: what this rank wrote."""
        return (
            f"exported {self.keys} key(s) in {len(self.files)} file(s) to {self.folder}: "
            f"{self.bytes_written / 2**20:.1f} MiB written by this rank in {self.seconds:.1f} s"
        )


@dataclass(frozen=True)
class _Plan:
    out: Path
    config: dict[str, Any]
    family: HFFamily
    limit: int
    chunks: dict[str, Chunk]
    itemsize: dict[str, int]
    generation: str | None


def export_hf_sharded(
    held: Mapping[str, Tensor],
    shapes: Mapping[str, tuple[int, ...]],
    dst: str | os.PathLike,
    *,
    config: Any,
    family: str | HFFamily | None = None,
    prefix: str = "",
    max_shard_bytes: int | str = DEFAULT_SHARD,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    generation_config: Any = None,
) -> ExportReport:
    """Write the model whose tensors the ranks hold as a Hugging Face checkpoint folder ``dst``; collective.

    Args:
        held: name -> the tensor this rank holds (plain or ``DTensor``, never on meta); names of the unsplit model.
        shapes: every name of the whole model -> its global shape (the same on every rank); names outside
            ``prefix`` are left out.
        dst, config, family, prefix, max_shard_bytes, dtype, overwrite, generation_config: as
            :func:`~.export.export_hf`.

    Returns:
        What this rank wrote.

    Raises:
        ValueError: as :func:`~.export.export_hf` (the keys checked against the model the config builds included),
            or a tensor under ``prefix`` that no rank holds: on every rank (the first rank's error), before anything
            is written.
        torch.distributed.checkpoint.api.CheckpointException: the ranks' boxes of a file's keys do not cover them
            exactly (tensors that are not one model's parts): on every rank, while that file is written.
    """
    started = time.perf_counter()
    plan: _Plan | None = None
    error: Exception | None = None
    try:
        plan = _plan(held, shapes, Path(dst), config, family, prefix, max_shard_bytes, dtype, overwrite,
                     generation_config)  # fmt: skip
    except (ValueError, TypeError, NotImplementedError) as err:
        error = err
    agree(error)
    assert plan is not None
    hf_shapes = {k[len(prefix) :]: tuple(int(s) for s in v) for k, v in shapes.items() if k.startswith(prefix)}
    itemsize = _gather_itemsizes(plan.itemsize)
    tied = bool(plan.config.get("tie_word_embeddings", False))
    entries = file_entries(hf_shapes, plan.family, tied=tied, owner=OWNER)
    error = _unheld(entries, itemsize, prefix)
    if error is not None:
        raise error  # the same on every rank: ``itemsize`` is gathered
    written_keys = {p.key: p.shape for _, p in entries}  # the same on every rank: from the global shapes
    check_keys_fit_config(written_keys, plan.config, plan.family, tied=tied, owner=OWNER)
    shards = file_shards(entries, itemsize, plan.limit)
    names = file_names(len(shards))
    rank, world = (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)
    if rank == 0:
        clear(plan.out)
    _barrier()
    written = 0
    for k, shard in enumerate(shards):
        written += _write_parts(plan, shard, itemsize, plan.out / PARTS / str(k), dtype)
    for k in range(rank, len(shards), world):  # each rank joins some of the files
        torch_compat.consolidate_hf_file(str(plan.out / PARTS / str(k)), str(plan.out / names[k]),
                                         [piece.key for _, piece in shards[k]])  # fmt: skip
    _barrier()
    if rank == 0:
        _finish(plan.out, plan.config, shards, names, itemsize, plan.generation)
    _barrier()
    return ExportReport(plan.out, tuple(sorted(names)), len(entries), written, time.perf_counter() - started)


def _write_parts(
    plan: _Plan, shard: list[tuple[str, Piece]], itemsize: Mapping[str, int], parts: Path, dtype: torch.dtype | None
) -> int:
    """One file's keys: each rank's boxes of them written to its safetensors parts in ``parts`` (collective), at most
    ``limit / PART_FRACTION`` bytes of file keys per part; the bytes this rank wrote."""
    pieces: dict[str, list[Piece]] = {}
    for name, piece in shard:
        pieces.setdefault(name, []).append(piece)
    mine = {n: c for n, c in plan.chunks.items() if n in pieces}
    buckets = file_shards(shard, itemsize, max(plan.limit // PART_FRACTION, 1))
    bucket_of = {piece.key: j for j, bucket in enumerate(buckets, start=1) for _, piece in bucket}
    planner = PieceSavePlanner({n: pieces[n] for n in mine}, dtype, expected=list(bucket_of))
    writer = HuggingFaceStorageWriter(str(parts), fqn_to_index_mapping=bucket_of, save_distributed=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # single process: intended
        dcp_save(mine, planner=planner, storage_writer=writer, no_dist=not _distributed())
    return planner.bytes_planned


def hf_model_path(module: torch.nn.Module) -> tuple[str, Any]:
    """``(prefix, model)``: the outermost Hugging Face causal LM in ``module`` (a ``PreTrainedModel`` with an
    ``lm_head``; ``module`` itself included) and where it sits in ``module``'s names (``"model."``, or ``""`` for
    ``module`` itself); ``("", None)`` when there is none or transformers is not installed."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - depends on the environment
        return "", None
    for name, sub in module.named_modules():
        if isinstance(sub, PreTrainedModel) and hasattr(sub, "lm_head"):
            return (f"{name}." if name else ""), sub
    return "", None


def _plan(
    held: Mapping[str, Tensor],
    shapes: Mapping[str, tuple[int, ...]],
    dst: Path,
    config: Any,
    family: str | HFFamily | None,
    prefix: str,
    max_shard_bytes: int | str,
    dtype: torch.dtype | None,
    overwrite: bool,
    generation_config: Any,
) -> _Plan:
    """Everything a rank can check alone, before any rank writes."""
    limit = parse_size(max_shard_bytes)
    out = check_destination(dst, overwrite)
    generation = generation_text(generation_config, config)
    found = written_config(config, dtype)
    chosen = select_family(family, found.get("model_type"), OWNER)
    mine = {k: v for k, v in held.items() if k.startswith(prefix)}
    if not any(k.startswith(prefix) for k in shapes):
        raise ValueError(
            f"{OWNER}: no key starts with prefix={prefix!r} (keys: {list(shapes)[:3]}). Pass the prefix of the HF "
            "model's attribute (`model.` for a LightningModule's `self.model`), or '' for the HF model's own."
        )
    unknown = sorted(k for k in mine if k not in shapes)
    if unknown:
        raise ValueError(
            f"{OWNER}: {unknown[:5]} are held but have no global shape in `shapes`. Rule: `shapes` names every "
            "tensor of the whole model and `held` what this rank holds of them. Fix: pass both from the same model."
        )
    chunks = {k[len(prefix) :]: chunk_of(k, v, tuple(int(s) for s in shapes[k]), OWNER) for k, v in mine.items()}
    itemsize = {
        k: (dtype.itemsize if dtype is not None and c.data.is_floating_point() else c.data.element_size())
        for k, c in chunks.items()
    }  # fmt: skip
    return _Plan(out, found, chosen, limit, chunks, itemsize, generation)


def _gather_itemsizes(mine: dict[str, int]) -> dict[str, int]:
    """``{name: bytes per element as written}`` of every tensor some rank holds."""
    if not _distributed():
        return dict(mine)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    merged: dict[str, int] = {}
    for part in every:
        merged.update(part)
    return merged


def _unheld(entries: list[tuple[str, Piece]], itemsize: Mapping[str, int], prefix: str) -> ValueError | None:
    missing = sorted({prefix + name for name, _ in entries if name not in itemsize})
    if not missing:
        return None
    return ValueError(
        f"{OWNER}: no rank holds {missing[:5]} ({len(missing)} tensor(s)). Rule: every tensor of the model is held "
        "by some rank (at pp > 1, by its stage). Fix: call it on every rank of the run, each passing what it holds "
        "(`held_tensors(model, pipeline)`, or `MoEOverlapStrategy.export_hf`)."
    )


def _finish(
    out: Path,
    config: dict[str, Any],
    shards: list[list[tuple[str, Piece]]],
    names: list[str],
    itemsize: Mapping[str, int],
    generation: str | None,
) -> None:
    """Rank 0, once every file is joined: the parts removed, the index (as :func:`~.export.export_hf` writes it)
    past one file, ``config.json`` and ``generation_config.json`` (when there is one)."""
    shutil.rmtree(out / PARTS, ignore_errors=True)
    if len(shards) > 1:
        weight_map = {p.key: name for name, shard in zip(names, shards) for _, p in shard}
        total = sum(p.numel * itemsize[t] for shard in shards for t, p in shard)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    (out / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if generation is not None:
        (out / GENERATION_CONFIG).write_text(generation)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


# -- from a saved checkpoint -------------------------------------------------------------------------------------
def export_checkpoint_hf(
    checkpoint: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    config: Any,
    prefix: str = "model.",
    family: str | HFFamily | None = None,
    max_shard_bytes: int | str = DEFAULT_SHARD,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    weights_only: bool = True,
    generation_config: Any = None,
) -> ExportReport:
    """Write the model of a sharded checkpoint directory this package saved as a Hugging Face folder, each process
    reading and writing ``1 / world`` of every tensor (rows of its first dimension): collective over the default
    process group where one is initialised (``torchrun --nproc-per-node N``), the whole model in one process
    otherwise.

    Args:
        checkpoint: the committed sharded checkpoint directory (format version 2).
        dst, config, prefix, family, max_shard_bytes, dtype, overwrite, generation_config: as
            :func:`export_hf_sharded`.
        weights_only: read every file without running code from it.

    Raises:
        ValueError: the checkpoint is a consolidated file or a version-1 directory (use :func:`~.export.export_hf`
            of :func:`~lightning_moe_overlap.checkpoint.consolidated.load_consolidated_state_dict`), holds no model
            key under ``prefix``; the errors of :func:`export_hf_sharded`.
    """
    from lightning_moe_overlap.checkpoint.parts import read_parts

    held, shapes = read_parts(Path(checkpoint), prefix, weights_only=weights_only, owner=OWNER)
    return export_hf_sharded(
        held, shapes, dst, config=config, family=family, prefix=prefix, max_shard_bytes=max_shard_bytes,
        dtype=dtype, overwrite=overwrite, generation_config=generation_config,
    )  # fmt: skip
