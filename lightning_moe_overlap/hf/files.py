"""A Hugging Face checkpoint folder as files: its ``config.json`` and the keys, shapes and dtypes of its tensors.

The folder is what ``save_pretrained`` and the Hub write: ``config.json`` and either ``model.safetensors`` or
``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``. Where the index exists only the files it
names count (a Hub folder may hold other ``.safetensors``, e.g. a second copy in another layout); without one every
``*.safetensors`` of the folder does. Only the files' headers are read here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_moe_overlap._install import install_hint

INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"  # the decoding defaults `from_pretrained` reads next to the model

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


@dataclass(frozen=True)
class FileTensor:
    """One key of the checkpoint: the file holding it (``relative_path``, as DCP's reader calls it), shape, dtype."""

    relative_path: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for size in self.shape:
            n *= size
        return n


def folder(path: str | os.PathLike, owner: str) -> Path:
    """``path`` as a checkpoint folder.

    Raises:
        ValueError: it is not a directory.
    """
    out = Path(path)
    if not out.is_dir():
        raise ValueError(
            f"{owner}: {out} is not a directory; a Hugging Face checkpoint is a folder with config.json and "
            "*.safetensors (as `save_pretrained` writes it). Pass the folder (download it first if it is on the Hub)."
        )
    return out


def read_config(path: Path) -> dict[str, Any]:
    """``config.json`` of the folder as a dict, ``{}`` when there is none."""
    file = path / CONFIG
    return json.loads(file.read_text()) if file.is_file() else {}


def safetensors_files(path: Path, owner: str) -> list[Path]:
    """The files that hold the checkpoint's tensors.

    Raises:
        ValueError: there is none, or the index names a file that is not there.
    """
    index = path / INDEX
    if index.is_file():
        names = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        files = [path / n for n in names]
        absent = [n for n, f in zip(names, files) if not f.is_file()]
        if absent:
            raise ValueError(
                f"{owner}: {index} names files that are not in the folder: {absent}. A sharded checkpoint needs every "
                "file of its index; download or copy the missing files."
            )
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{owner}: {path} has no *.safetensors file; a Hugging Face checkpoint holds its weights in "
            "model.safetensors or model-0000k-of-0000n.safetensors. Pass the folder `save_pretrained` wrote."
        )
    return files


def check_complete(file: Path, owner: str) -> None:
    """Refuse a safetensors file whose header or data is cut short (an interrupted download or copy) with one error
    naming it, before safetensors' own "incomplete metadata, file not fully covered" on every rank.

    Raises:
        ValueError: the file is shorter than its header says, or its header is not safetensors'.
    """
    size = file.stat().st_size
    problem = None
    with open(file, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 0 or 8 + length > size:
            problem = f"its header needs {max(length, 0) + 8} bytes and the file has {size}"
        else:
            try:
                header = json.loads(f.read(length))
            except ValueError:
                header = None
                problem = "its header is not a safetensors header (JSON)"
            if header is not None:
                ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and "data_offsets" in t]
                needed = 8 + length + max(ends, default=0)
                if needed > size:
                    problem = f"its header says its tensors need {needed} bytes and the file has {size}"
    if problem is not None:
        raise ValueError(
            f"{owner}: {file} is incomplete or not a safetensors file: {problem}. Rule: every file of the checkpoint "
            "is read whole by some rank. Fix: download or copy the file again (an interrupted transfer leaves it "
            "short)."
        )


def read_keys(path: Path, owner: str) -> dict[str, FileTensor]:
    """Every key of the checkpoint with its file, shape and dtype (headers only).

    Raises:
        ValueError: a file is incomplete (:func:`check_complete`), a key is in two files, or a dtype is not one torch
            reads from safetensors.
        ImportError: ``safetensors`` is not installed.
    """
    try:
        from safetensors import safe_open
    except ImportError as err:  # pragma: no cover - depends on the environment
        hint = install_hint("hf")
        raise ImportError(f"{owner} needs `safetensors`, which is not installed. Install {hint}.") from err
    keys: dict[str, FileTensor] = {}
    for file in safetensors_files(path, owner):
        check_complete(file, owner)
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                view = f.get_slice(key)
                dtype = view.get_dtype()
                if dtype not in DTYPES:
                    raise ValueError(
                        f"{owner}: key {key!r} of {file.name} has dtype {dtype}, which is not one of "
                        f"{sorted(DTYPES)}. Convert the checkpoint to one of them."
                    )
                if key in keys:
                    raise ValueError(
                        f"{owner}: key {key!r} is in both {Path(keys[key].relative_path).name} and {file.name}; each "
                        f"key must be in one file. Remove the duplicate file (or write {INDEX} naming the files "
                        "to use)."
                    )
                keys[key] = FileTensor(str(file), tuple(view.get_shape()), DTYPES[dtype])
    return keys
