"""Reading a checkpoint without running code from it: what ``weights_only=True`` (the default) accepts.

Every non-tensor part of a checkpoint is a pickle, and unpickling an arbitrary pickle runs whatever code it names.
With ``weights_only=True`` each file is read by a loader that accepts only data:

- ``meta.pt``, a consolidated file, DCP's non-tensor entries (optimizer hyper-parameters, RNG states) and each
  rank's RNG state: ``torch.load(weights_only=True)``: plain containers, numbers, strings, tensors, and the types
  registered with ``torch.serialization.add_safe_globals``. RNG states written before this loader also hold a
  NumPy array: its reconstruction (``_reconstruct``, ``ndarray``, ``dtype``) is allowed for them only.
- DCP's ``.metadata`` (torch's own format, which DCP reads with ``pickle.load``): unpickled here first with only
  DCP's metadata classes, ``torch.Size``, torch dtypes and layouts and ``pathlib`` paths allowed.
- version-1 entries pickled by hand: plain values only (no global at all).

A file that needs more is refused with a ``ValueError`` naming it, what it asks for, and the opt-out:
``weights_only=False`` (or torch's ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` where the argument is ``None``) reads
every file with plain pickle, for checkpoints from a trusted source only.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import importlib
import io
import os
import pathlib
import pickle
import re
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

DCP_METADATA = ".metadata"
_DCP_MODULES = frozenset({"torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"})
_PATHS = frozenset({"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"})
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def add_weights_only_flag(parser: Any) -> None:
    """The ``--no-weights-only`` option of the checkpoint subcommands (``args.weights_only``, default True)."""
    parser.add_argument(
        "--no-weights-only", dest="weights_only", action="store_false",
        help="unpickle the checkpoint's files without restriction (runs code they name: trusted sources only)",
    )


def resolve(weights_only: bool | None) -> bool:
    """Whether to load weights-only, as ``torch.load`` decides it: ``None`` (Lightning's default) means ``True``
    unless ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set; ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` forces ``True``."""
    if _env_flag("TORCH_FORCE_WEIGHTS_ONLY_LOAD"):
        return True
    if weights_only is None:
        return not _env_flag("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    return bool(weights_only)


def _env_flag(name: str) -> bool:
    return os.getenv(name, "0").lower() in ("1", "y", "yes", "true")


def refusal(where: str, asks: str) -> ValueError:
    """The error for a checkpoint file that a weights-only load refuses."""
    return ValueError(
        f"`MoEOverlapStrategy`: {where} holds {asks}, which a weights-only load refuses: unpickling it could run "
        "code from the file. Rule: checkpoints load with `weights_only=True` (the default): plain containers, "
        "numbers, strings, tensors and types registered with `torch.serialization.add_safe_globals`. Fix: register "
        "the exact types it needs with `torch.serialization.add_safe_globals`, or, only if you trust the "
        "checkpoint's source, load it with `weights_only=False`: set `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1` in the "
        "environment of every rank (torch's switch, which `trainer.fit(ckpt_path=...)` honours on every Lightning "
        "version), pass `weights_only=False` to `consolidate_checkpoint` / `load_consolidated_state_dict` / "
        "`convert_legacy_checkpoint`, or `--no-weights-only` to `lightning-moe-overlap convert-checkpoint`."
    )


def load(source: str | Path | IO[bytes], where: str, *, weights_only: bool, **kwargs: Any) -> Any:
    """``torch.load(source, weights_only=...)`` that names ``where`` (the file) when a weights-only load refuses it.

    Raises:
        ValueError: ``weights_only`` and the file needs a type that is not allowed.
    """
    try:
        return torch.load(source, map_location="cpu", weights_only=weights_only, **kwargs)
    except pickle.UnpicklingError as err:
        if not weights_only or "Weights only load failed" not in str(err):
            raise  # not a refusal: a damaged file
        names = sorted(set(_GLOBAL.findall(str(err))))
        raise refusal(where, f"objects of {names}" if names else "objects that are not plain data") from err


def load_rng(blob: bytes, where: str, *, weights_only: bool) -> Any:
    """An RNG state saved with the checkpoint; one written before this loader holds a NumPy array (allowed here)."""
    registered = set(torch.serialization.get_safe_globals())
    missing = [g for g in _numpy_array_globals() if g not in registered]  # the context removes what it added
    with torch.serialization.safe_globals(missing):
        return load(io.BytesIO(blob), where, weights_only=weights_only)


def _numpy_array_globals() -> list[Any]:
    """The globals that rebuild a NumPy array (NumPy 2 and NumPy 1 module names), or none without NumPy."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is optional
        return []
    rebuild = np.empty(0).__reduce__()[0]
    return [np.ndarray, np.dtype, type(np.dtype(np.uint32)), rebuild, (rebuild, "numpy.core.multiarray._reconstruct")]


# -- DCP's .metadata ------------------------------------------------------------------------------------------
class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``: its own metadata classes and the torch values they hold, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        found = _allowed_metadata_global(module, name)
        if found is None:
            raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")
        return found


def _allowed_metadata_global(module: str, name: str) -> Any | None:
    if "." in name:
        return None
    if module in _DCP_MODULES:
        value = getattr(importlib.import_module(module), name, None)
        own = isinstance(value, type) and value.__module__ == module
        return value if own and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum)) else None
    if module == "torch":
        value = getattr(torch, name, None)
        return value if value is torch.Size or isinstance(value, (torch.dtype, torch.layout)) else None
    if module == "torch.serialization" and name == "_get_layout":  # how torch pickles a torch.layout
        return _layout
    if module == "pathlib" and name in _PATHS:
        return getattr(pathlib, name)
    if (module, name) == ("collections", "OrderedDict"):
        return collections.OrderedDict
    return None


def _layout(name: str) -> torch.layout:
    """A torch layout by its name (``"torch.strided"``), from torch's public attributes only."""
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.layout):
        raise pickle.UnpicklingError(f"layout {name!r}")
    return value


def read_dcp_metadata(path: Path, *, weights_only: bool) -> Metadata:
    """DCP's ``.metadata`` of a checkpoint directory, through the allow-list when ``weights_only``.

    Raises:
        ValueError: ``weights_only`` and the file names anything but DCP's metadata types.
    """
    if not weights_only:
        return FileSystemReader(path).read_metadata()
    where = f"the DCP metadata file {path / DCP_METADATA}"
    with open(path / DCP_METADATA, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f).load()
        except pickle.UnpicklingError as err:
            raise refusal(where, f"objects of {_GLOBAL.findall(str(err)) or [str(err)]}") from err
    if not isinstance(metadata, Metadata):
        raise refusal(where, f"a {type(metadata).__name__} instead of DCP's `Metadata`")
    return metadata


# -- DCP's non-tensor entries ---------------------------------------------------------------------------------
class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with each non-tensor entry read by ``torch.load(weights_only=True)``.

    A refused entry is kept as ``None`` and its error in :attr:`refused` (DCP would wrap an error raised here),
    for :func:`dcp_load` to raise once the load has returned.
    """

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.refused: ValueError | None = None

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = load(value, f"the entry `{fqn}` of the DCP checkpoint {self.path}", weights_only=True)
        except ValueError as err:
            self.refused, loaded = self.refused or err, None
        if not self.flatten_state_dict:
            self.state_dict[fqn] = loaded
            return
        container: Any = self.original_state_dict
        *parents, last = self.mappings[fqn]
        for key in parents:
            container = container[key]
        container[last] = loaded


def dcp_load(state: dict[str, Any], path: Path, *, weights_only: bool, no_dist: bool) -> ValueError | None:
    """``dcp.load(state, checkpoint_id=path)``, its non-tensor entries weights-only when ``weights_only``.

    Returns the refusal of the first entry that needs more than plain data (``None`` when every entry loaded); the
    caller raises it, after agreeing across ranks when it loads collectively.
    """
    planner = WeightsOnlyLoadPlanner(path) if weights_only else None
    dcp.load(state, checkpoint_id=path, planner=planner, no_dist=no_dist)
    return None if planner is None else planner.refused


# -- version 1: values pickled by hand ------------------------------------------------------------------------
class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")


def plain_loads(data: bytes, where: str, *, weights_only: bool) -> Any:
    """A value pickled with ``pickle.dumps``; with ``weights_only`` only plain values (no global) are accepted."""
    if not weights_only:
        return pickle.loads(data)
    try:
        return _PlainUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as err:
        raise refusal(where, f"objects of {_GLOBAL.findall(str(err)) or [str(err)]}") from err
