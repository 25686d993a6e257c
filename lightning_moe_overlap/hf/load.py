"""Load a published Hugging Face checkpoint into a model, each rank reading only the tensors (and parts) it holds.

:func:`load_hf_weights` is the whole procedure, in three phases:

1. **Match** (no tensor data read): the files' keys and shapes (headers) against the model's global shapes, through
   the key family (:mod:`.families`); any missing, unexpected or misshapen key fails here, with one error naming
   them all (:mod:`.key_match`). The answer depends only on the files and ``shapes``, so it is the same on every rank.
2. **Plan**: for each tensor this rank holds (a plain tensor, or a ``DTensor``'s local chunk at its global offset),
   one read per piece that meets it (:mod:`.planner`).
3. **Read** through ``torch.distributed.checkpoint.load`` with DCP's ``HuggingFaceStorageReader``: each read takes
   only its box of the file tensor and copies it into the held tensor, converting the dtype (bf16 files into fp32
   weights). Collective where a process group is initialised (every rank calls it, each with its own tensors).
   Block-scaled FP8 files (DeepSeek-V3's ``weight_scale_inv``) are dequantised as they are read, each box with the
   scale blocks that cover it (:mod:`.fp8_weights`).

:class:`HFWeights` is what a LightningModule declares for the strategy to load after sharding.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from lightning_moe_overlap.hf.families import select_family
from lightning_moe_overlap.hf.files import FileTensor, folder, read_config, read_keys
from lightning_moe_overlap.hf.fp8_weights import BlockScaledPlanner, BlockScales, split_scales
from lightning_moe_overlap.hf.key_match import plan_pieces
from lightning_moe_overlap.hf.keys import HFFamily, Piece
from lightning_moe_overlap.hf.planner import PieceLoadPlanner, chunk_of

OWNER = "`load_hf_weights`"


@dataclass(frozen=True)
class HFLoadReport:
    """What one rank read.

    Attributes:
        family: the key family used.
        tensors: model tensors written on this rank (held ones).
        keys: file keys this rank read from (all or part of), sorted.
        reads: boxes read (one per piece and held chunk that meet).
        bytes_read: bytes of file data those boxes hold (in the files' dtypes).
        seconds: wall time of the whole load on this rank (match, plan and read).
        dequantized: FP8 weight keys this rank dequantised with their block scales (``_scale_inv``), sorted.
        block: the scales' block size, or None for a high-precision checkpoint.
    """

    family: str
    tensors: int
    keys: tuple[str, ...]
    reads: int
    bytes_read: int
    seconds: float = 0.0
    dequantized: tuple[str, ...] = ()
    block: tuple[int, int] | None = None

    @classmethod
    def combined(cls, reports: Sequence[HFLoadReport]) -> HFLoadReport:
        """One report for several checkpoints read in turn (one per declared ``HFWeights``): counts and times summed,
        families joined with ``+``, keys and dequantised keys merged."""
        blocks = {r.block for r in reports if r.block is not None}
        return cls(
            family="+".join(r.family for r in reports),
            tensors=sum(r.tensors for r in reports),
            keys=tuple(sorted({k for r in reports for k in r.keys})),
            reads=sum(r.reads for r in reports),
            bytes_read=sum(r.bytes_read for r in reports),
            seconds=sum(r.seconds for r in reports),
            dequantized=tuple(sorted({k for r in reports for k in r.dequantized})),
            block=next(iter(blocks)) if len(blocks) == 1 else None,
        )

    def describe(self) -> str:
        """One line for the log: what this rank read."""
        fp8 = (
            f", {len(self.dequantized)} FP8 weight(s) dequantised with their {list(self.block)} block scales"
            if self.block is not None else ""
        )  # fmt: skip
        return (
            f"loaded {self.tensors} tensor(s) from {len(self.keys)} checkpoint key(s) (family {self.family!r}): "
            f"{self.reads} read(s), {self.bytes_read / 2**20:.1f} MiB on this rank in {self.seconds:.1f} s{fp8}"
        )


def load_hf_weights(
    held: Mapping[str, Tensor],
    shapes: Mapping[str, Sequence[int]],
    path: str | os.PathLike,
    *,
    family: str | HFFamily | None = None,
    prefix: str = "",
    ignore: Sequence[str] = (),
    process_group: dist.ProcessGroup | None = None,
) -> HFLoadReport:
    """Read a Hugging Face checkpoint folder into the tensors this rank holds.

    Args:
        held: name -> the tensor this rank holds (a parameter or persistent buffer, plain or ``DTensor``), written
            in place. Names are those of the unsplit model, ``prefix`` included.
        shapes: every name of the whole model (held here or elsewhere) -> its global shape; these decide the
            checks, so they must be the same on every rank.
        path: the folder (``config.json`` and ``*.safetensors``, single file or sharded with an index).
        family: the key layout of the files (:mod:`.families`): a family, its name or a ``model_type``; default:
            the one for ``config.json``'s ``model_type``.
        prefix: where the HF model sits in the names (``"model."`` for a LightningModule's ``self.model``).
        ignore: regex patterns (``re.search``) of file keys that no tensor takes and that are fine to skip (e.g.
            DeepSeek-V3's multi-token-prediction layer, ``r"^model\\.layers\\.61\\."``).
        process_group: the group the read is coordinated over (default: the default group, when initialised).

    Returns:
        What this rank read.

    Raises:
        ValueError: a name of ``shapes`` does not start with ``prefix``, ``held`` names a tensor ``shapes`` does
            not, the folder is no checkpoint, or the checkpoint does not fill the model exactly
            (:class:`~lightning_moe_overlap.hf.key_match.HFKeysError`: missing, unexpected and misshapen keys), or its
            FP8 weights and their ``_scale_inv`` scales do not fit (:func:`~.fp8_weights.split_scales`).
        NotImplementedError: a block-scaled FP8 weight is not 2-D.
    """
    started = time.perf_counter()
    root = folder(path, OWNER)
    outside = sorted(n for n in shapes if not n.startswith(prefix))
    unknown = sorted(n for n in held if n not in shapes)
    if outside or unknown:
        raise ValueError(
            f"{OWNER}: names outside prefix={prefix!r}: {outside[:5]}; names in `held` but not in `shapes`: "
            f"{unknown[:5]}. Rule: `shapes` lists every tensor of the HF model (under `prefix`) and `held` a subset. "
            "Fix: pass the prefix of the HF model's attribute, and load other tensors separately."
        )
    chosen, files, pieces, scales = match_files(root, shapes, family=family, prefix=prefix, ignore=ignore)
    chunks = {n: chunk_of(n, t, tuple(int(s) for s in shapes[n]), OWNER) for n, t in held.items()}
    mine = {n: pieces[n[len(prefix) :]] for n in held}
    planner = PieceLoadPlanner(mine) if scales is None else BlockScaledPlanner(mine, scales)
    distributed = dist.is_available() and dist.is_initialized()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # single process: intended
        dcp_load(
            dict(chunks), storage_reader=_Reader(root, files), planner=planner, process_group=process_group,
            no_dist=not distributed,
        )  # fmt: skip
    read = planner.committed
    keys = {r.storage_index.fqn for r in read}
    return HFLoadReport(
        family=chosen.name,
        tensors=len(held),
        keys=tuple(sorted(keys)),
        reads=len(read),
        bytes_read=sum(_numel(r.lengths) * files[r.storage_index.fqn].dtype.itemsize for r in read),
        seconds=time.perf_counter() - started,
        dequantized=() if scales is None else tuple(sorted(keys & set(scales.scales))),
        block=None if scales is None else scales.block,
    )


def match_files(
    root: Path,
    shapes: Mapping[str, Sequence[int]],
    *,
    family: str | HFFamily | None,
    prefix: str,
    ignore: Sequence[str],
) -> tuple[HFFamily, dict[str, FileTensor], dict[str, list[Piece]], BlockScales | None]:
    """The match phase alone (headers only, no tensor data): the family, the files' keys (all of them), the pieces
    of every tensor of ``shapes`` (HF names, ``prefix`` removed) and the FP8 block scales (:mod:`.fp8_weights`; None
    for a high-precision checkpoint); :class:`~.checks.HFKeysError` when they do not fit."""
    config = read_config(root)
    chosen = select_family(family, config.get("model_type"), OWNER)
    files = read_keys(root, OWNER)
    weights, scales = split_scales(config, files, OWNER)  # the `_scale_inv` keys are the weights', not the model's
    hf_shapes = {n[len(prefix) :]: s for n, s in shapes.items()}
    tied = bool(config.get("tie_word_embeddings", False))
    pieces = plan_pieces(hf_shapes, weights, chosen, tied=tied, ignore=ignore, where=str(root), owner=OWNER)
    return chosen, files, pieces, scales


def _numel(lengths: Sequence[int]) -> int:
    n = 1
    for size in lengths:
        n *= size
    return n


class _Reader(HuggingFaceStorageReader):
    """DCP's HF reader over the files of :func:`~.files.read_keys` (headers already read; only the index's files)."""

    def __init__(self, path: os.PathLike, files: Mapping[str, FileTensor]) -> None:
        super().__init__(str(path))
        self.files = files

    def read_metadata(self) -> Metadata:
        state, storage = {}, {}
        for key, f in self.files.items():
            zeros = torch.Size([0] * len(f.shape))
            state[key] = TensorStorageMetadata(
                TensorProperties(dtype=f.dtype), torch.Size(f.shape), [ChunkStorageMetadata(zeros, torch.Size(f.shape))]
            )
            storage[MetadataIndex(key, zeros)] = f  # ``relative_path``: the file the reader opens
        return Metadata(state_dict_metadata=state, storage_data=storage)


def module_tensors(module: nn.Module) -> tuple[dict[str, Tensor], dict[str, tuple[int, ...]]]:
    """``(held, shapes)`` of a module for :func:`load_hf_weights`: its parameters and persistent buffers (the state
    dict's tensors), held where they are not on the meta device; a ``DTensor``'s shape is its global shape."""
    state = module.state_dict(keep_vars=True)
    shapes = {n: tuple(t.shape) for n, t in state.items()}
    held = {n: t for n, t in state.items() if not t.is_meta}
    return held, shapes


@dataclass(frozen=True)
class HFWeights:
    """Weights a LightningModule starts from: a Hugging Face checkpoint folder, loaded after the model is sharded.

    Declare it on the module (``self.hf_weights = HFWeights("Qwen/Qwen3-30B-A3B-local-dir")``); the strategy calls
    :meth:`load_into` once the model is parallelised, so every rank reads only what it holds.

    Attributes:
        path: the checkpoint folder (``config.json`` and ``*.safetensors``).
        prefix: the attribute path of the HF model inside the module, with a trailing dot (``"model."``).
        family: the key layout (default: from ``config.json``'s ``model_type``).
        ignore: regex patterns of file keys to skip.
    """

    path: str | os.PathLike
    prefix: str = "model."
    family: str | HFFamily | None = None
    ignore: tuple[str, ...] = field(default=())

    def check(self, shapes: Mapping[str, Sequence[int]]) -> None:
        """Whether the files fill the model of ``shapes`` (every name of the module, global shapes; those under
        ``prefix`` count) exactly, reading only their headers: the errors :func:`load_hf_weights` would raise before
        reading anything (``lightning-moe-overlap check`` runs it on the model built on the meta device)."""
        mine = {n: s for n, s in shapes.items() if n.startswith(self.prefix)}
        match_files(folder(self.path, OWNER), mine, family=self.family, prefix=self.prefix, ignore=self.ignore)

    def load_into(self, module: nn.Module, process_group: dist.ProcessGroup | None = None) -> HFLoadReport:
        """Load into ``module``'s tensors under ``prefix`` (see :func:`load_hf_weights`); collective where a process
        group is initialised."""
        held, shapes = module_tensors(module)
        held = {n: t for n, t in held.items() if n.startswith(self.prefix)}
        shapes = {n: s for n, s in shapes.items() if n.startswith(self.prefix)}
        return load_hf_weights(
            held, shapes, self.path, family=self.family, prefix=self.prefix, ignore=self.ignore,
            process_group=process_group,
        )  # fmt: skip


def as_hf_weights(value: object, owner: str) -> HFWeights:
    """``value`` as :class:`HFWeights`: itself, or a folder path (``str`` / ``PathLike``) with the defaults."""
    if isinstance(value, HFWeights):
        return value
    if isinstance(value, (str, os.PathLike)):
        return HFWeights(value)
    raise TypeError(
        f"{owner}: `hf_weights` is a {type(value).__name__} ({value!r}). Rule: a LightningModule declares the weights "
        "it starts from as an `HFWeights` or a checkpoint folder's path (a list of them for several models), or None. "
        "Fix: set `self.hf_weights = HFWeights(path)` (lightning_moe_overlap.hf), a path, a list, or None."
    )


def as_hf_weights_list(value: object, owner: str) -> list[HFWeights]:
    """What a module's ``hf_weights`` declares, as a list: ``[]`` for None, one :class:`HFWeights` (or path), or a list
    / tuple of them (one per HF model of the module, each under its own prefix).

    Raises:
        TypeError: an entry is neither (:func:`as_hf_weights`).
        ValueError: two prefixes overlap (one starts with the other): a tensor would be loaded twice.
    """
    if value is None:
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    entries = [as_hf_weights(v, owner) for v in values]
    for i, a in enumerate(entries):
        for b in entries[i + 1 :]:
            if a.prefix.startswith(b.prefix) or b.prefix.startswith(a.prefix):
                raise ValueError(
                    f"{owner}: `hf_weights` declares prefix={a.prefix!r} ({a.path}) and prefix={b.prefix!r} "
                    f"({b.path}), and one starts with the other. Rule: each declared checkpoint fills the tensors "
                    "under its own prefix, one HF model each. Fix: give each the attribute path of its own model "
                    "(`\"model.\"`, `\"draft.\"`), or declare only one of them."
                )
    return entries

