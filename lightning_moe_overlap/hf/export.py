"""Export a model's state dict as a Hugging Face checkpoint folder, in the layout the Hub and ``save_pretrained`` use.

The folder holds ``config.json`` and the tensors under the Hub's keys (per-expert ``experts.N.*`` tensors cut from
the fused v5 ones by the family's pieces, :mod:`.keys`), in ``model.safetensors`` or, past ``max_shard_bytes``,
``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``. ``AutoModelForCausalLM.from_pretrained``,
vLLM and SGLang read it. With ``tie_word_embeddings`` the tied tensor is left out, as ``save_pretrained`` does.

The ``export-hf`` subcommand (:func:`main`) does it for a checkpoint this package saved (sharded directory or
consolidated file), read whole in one process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_moe_overlap._install import install_hint
from lightning_moe_overlap.hf.config_match import check_keys_fit_config
from lightning_moe_overlap.hf.families import select_family
from lightning_moe_overlap.hf.file_layout import file_entries, file_names, file_shards
from lightning_moe_overlap.hf.files import CONFIG, GENERATION_CONFIG, INDEX
from lightning_moe_overlap.hf.keys import HFFamily, Piece

OWNER = "`export_hf`"
DEFAULT_SHARD = "5GB"
PARTS = ".export-parts"  # a sharded export's per-rank files before they are consolidated (removed after)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    """Bytes of ``size``: an int, or a string as ``save_pretrained`` takes it (``"5GB"`` = 5e9, ``"500MiB"``).

    Raises:
        ValueError: not a positive size.
    """
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(
            f"{OWNER}: max shard size {size!r} is not a positive size. Pass bytes (an int) or a number with a unit "
            f"of {sorted(u for u in _UNITS if u)} (e.g. '5GB', '500MiB')."
        )
    return int(float(match.group(1)) * _UNITS[unit])


def export_hf(
    state_dict: Mapping[str, Tensor],
    dst: str | os.PathLike,
    *,
    config: Any,
    family: str | HFFamily | None = None,
    prefix: str = "",
    max_shard_bytes: int | str = DEFAULT_SHARD,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    generation_config: Any = None,
) -> Path:
    """Write ``state_dict`` (whole tensors) as a Hugging Face checkpoint folder ``dst``.

    Args:
        state_dict: the model's tensors, unsharded (e.g. :func:`~lightning_moe_overlap.checkpoint.consolidated.
            load_consolidated_state_dict`); keys outside ``prefix`` are left out.
        dst: the folder to write (created; must be empty unless ``overwrite``).
        config: the model's config: a transformers ``PretrainedConfig``, a ``config.json`` path or a folder holding
            one. Written as ``dst/config.json`` without its ``quantization_config`` (the tensors are written in
            their own dtype: a model loaded from an FP8 checkpoint leaves in high precision); its ``model_type``
            picks the key family.
        family: the key layout to write (a family, its name or a ``model_type``); default from the config.
        prefix: where the HF model sits in the keys (``"model."`` for a LightningModule's ``self.model``).
        max_shard_bytes: the largest file (bytes, or ``"5GB"``-style); one tensor larger than it gets a file alone.
        dtype: cast floating-point tensors to it (and record it in ``config.json``); default: as they are.
        overwrite: replace the checkpoint files of a non-empty ``dst`` (other files are kept).
        generation_config: the decoding defaults written as ``generation_config.json`` (a transformers
            ``GenerationConfig``, a dict, or a path to the file or its folder); default: the
            ``generation_config.json`` next to ``config`` when it is a path, else none.

    Returns:
        ``dst``.

    Raises:
        ValueError: ``dst`` is not empty, no key is under ``prefix``, a tensor cannot be cut by the family, the
            config has no ``model_type``, ``max_shard_bytes`` is not a size, or the keys are not those of the model
            the config builds (:mod:`.config_match`: the folder would not load without missing or unexpected keys).
        TypeError: a tensor is a ``DTensor`` (pass the full state dict).
    """
    limit = parse_size(max_shard_bytes)
    out = check_destination(Path(dst), overwrite)
    generation = generation_text(generation_config, config)
    config_dict = written_config(config, dtype)
    chosen = select_family(family, config_dict.get("model_type"), OWNER)
    tensors = _hf_tensors(state_dict, prefix, dtype)
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    tied = bool(config_dict.get("tie_word_embeddings", False))
    entries = file_entries(shapes, chosen, tied=tied, owner=OWNER)
    check_keys_fit_config({p.key: p.shape for _, p in entries}, config_dict, chosen, tied=tied, owner=OWNER)
    shards = file_shards(entries, {k: v.element_size() for k, v in tensors.items()}, limit)
    clear(out)
    names = file_names(len(shards))
    save_file = _save_file()
    weight_map: dict[str, str] = {}
    for name, shard in zip(names, shards):
        save_file({p.key: _cut(tensors[t], p) for t, p in shard}, str(out / name), metadata={"format": "pt"})
        readable(out / name)
        weight_map.update({p.key: name for _, p in shard})
    if len(shards) > 1:
        total = sum(p.numel * tensors[t].element_size() for t, p in entries)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    (out / CONFIG).write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    if generation is not None:
        (out / GENERATION_CONFIG).write_text(generation)
    return out


def check_destination(dst: Path, overwrite: bool) -> Path:
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"{OWNER}: {dst} is a file; the destination is a folder. Pass a folder path.")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise ValueError(
            f"{OWNER}: {dst} is not empty ({sorted(p.name for p in dst.iterdir())[:5]}); an export writes a whole "
            "checkpoint folder, and stale shards would be read with it. Pass an empty or new folder, or "
            "overwrite=True (`--overwrite`) to replace its checkpoint files."
        )
    return dst


def generation_text(generation_config: Any, config: Any) -> str | None:
    """The ``generation_config.json`` to write: from ``generation_config`` (a ``GenerationConfig``, a dict, or a path
    to the file or its folder), or else the one next to ``config`` when that is a path; None when there is none.

    Raises:
        ValueError: ``generation_config`` is a path with no such file.
    """
    source = generation_config if generation_config is not None else config
    if hasattr(source, "to_json_string") and generation_config is not None:  # a transformers GenerationConfig
        return source.to_json_string(use_diff=True)
    if isinstance(source, Mapping) and generation_config is not None:
        return json.dumps(dict(source), indent=2, sort_keys=True) + "\n"
    if not isinstance(source, (str, os.PathLike)):
        return None
    path = Path(source)
    explicit = generation_config is not None
    file = path / GENERATION_CONFIG if path.is_dir() else (path if explicit else path.with_name(GENERATION_CONFIG))
    if file.is_file():
        return file.read_text()
    if explicit:
        raise ValueError(
            f"{OWNER}: generation_config={str(source)!r} is neither a generation_config.json nor a folder holding "
            "one. Pass the file, its folder, a `GenerationConfig` or a dict, or leave it out."
        )
    return None


def readable(path: Path) -> None:
    """Give ``path`` the mode a new file gets under the process's umask (safetensors writes through a private
    temporary file: 0600, which a serving process of another user could not read)."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def clear(dst: Path) -> None:
    """Remove the checkpoint files of an earlier export (other files stay, a sharded export's parts go); create
    ``dst``."""
    for old in [*dst.glob("model*.safetensors"), dst / INDEX, dst / CONFIG, dst / GENERATION_CONFIG, dst / PARTS]:
        if old.is_dir():
            shutil.rmtree(old)
        elif old.exists():
            old.unlink()
    dst.mkdir(parents=True, exist_ok=True)


def written_config(config: Any, dtype: torch.dtype | None) -> dict[str, Any]:
    """The ``config.json`` an export writes: ``config`` (:func:`config_dict_of`) without its ``quantization_config``
    (the tensors are written as they are: high precision, no scales), with ``dtype`` recorded when given."""
    found = config_dict_of(config)
    found.pop("quantization_config", None)
    if dtype is not None:
        found["dtype"] = str(dtype).removeprefix("torch.")
    return found


def config_dict_of(config: Any) -> dict[str, Any]:
    if hasattr(config, "to_json_string"):  # a transformers PretrainedConfig
        found = json.loads(config.to_json_string(use_diff=True))
        found.setdefault("model_type", getattr(config, "model_type", None))
    else:
        path = Path(config)
        file = path / CONFIG if path.is_dir() else path
        if not file.is_file():
            raise ValueError(
                f"{OWNER}: config={str(config)!r} is neither a config.json nor a folder holding one. Pass the "
                "model's `PretrainedConfig`, its config.json, or the folder of the checkpoint it was trained from."
            )
        found = json.loads(file.read_text())
    if not found.get("model_type"):
        raise ValueError(
            f"{OWNER}: the config has no `model_type`, which `from_pretrained` needs to pick the model class. Pass "
            "the model's own config (`model.config`)."
        )
    return found


def _hf_tensors(state_dict: Mapping[str, Tensor], prefix: str, dtype: torch.dtype | None) -> dict[str, Tensor]:
    tensors = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    if not tensors:
        raise ValueError(
            f"{OWNER}: no key starts with prefix={prefix!r} (keys: {list(state_dict)[:3]}). Pass the prefix of "
            "the HF model's attribute (`model.` for a LightningModule's `self.model`), or '' for the HF model's own."
        )
    sharded = sorted(k for k, v in tensors.items() if isinstance(v, DTensor))
    if sharded:
        raise TypeError(
            f"{OWNER}: {sharded[:3]} are DTensors, parts of tensors held across ranks. Pass the full state dict "
            "(`strategy.full_state_dict()` or `load_consolidated_state_dict` of a saved checkpoint)."
        )
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    return tensors


def _cut(tensor: Tensor, piece: Piece) -> Tensor:
    index = tuple(b if isinstance(b, int) else slice(*b) for b in piece.box)
    return tensor[index].contiguous()


def _save_file() -> Any:
    try:
        from safetensors.torch import save_file
    except ImportError as err:  # pragma: no cover - depends on the environment
        hint = install_hint("hf")
        raise ImportError(f"{OWNER} needs `safetensors`, which is not installed. Install {hint}.") from err
    return save_file
