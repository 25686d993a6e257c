"""The Hub's folder layout of a model's tensors: which file key holds which piece (:func:`file_entries`), which
file holds which keys (:func:`file_shards`, as ``save_pretrained`` splits by size) and the files' names. Shared by
the whole export (:mod:`.export`), the sharded one (:mod:`.sharded_export`) and the check against the config
(:mod:`.config_match`), so the three agree on the folder.
"""

from __future__ import annotations

from collections.abc import Mapping

from lightning_moe_overlap.hf.key_match import covers
from lightning_moe_overlap.hf.keys import HFFamily, Piece


def file_entries(
    shapes: Mapping[str, tuple[int, ...]], family: HFFamily, *, tied: bool, owner: str
) -> list[tuple[str, Piece]]:
    """``(tensor name, piece)`` of every file key, in ``shapes``' order (the state dict's): the tensors' global
    shapes cut by ``family``; with ``tied`` the tied tensors are left out, as ``save_pretrained`` leaves them.

    Raises:
        ValueError: a tensor cannot be cut by the family, or the family writes one key for two tensors.
    """
    skip = {t for t, source in family.ties if source in shapes} if tied else set()
    entries: list[tuple[str, Piece]] = []
    for name, shape in shapes.items():
        if name in skip:
            continue
        pieces = family.pieces(name, shape)
        if pieces is None or not covers(pieces, shape):
            raise ValueError(
                f"{owner}: {name} of shape {list(shape)} cannot be cut into the key family {family.name!r}'s pieces "
                "(each element in exactly one). Pass the family of this model's layout, or fix the family's splits."
            )
        entries += [(name, p) for p in pieces]
    keys = [p.key for _, p in entries]
    twice = sorted({k for k in keys if keys.count(k) > 1}) if len(set(keys)) < len(keys) else []
    if twice:
        raise ValueError(
            f"{owner}: the key family {family.name!r} writes {twice[:5]} for more than one tensor; each key names one "
            "tensor. Fix the family's renames."
        )
    return entries


def file_shards(
    entries: list[tuple[str, Piece]], itemsize: Mapping[str, int], limit: int
) -> list[list[tuple[str, Piece]]]:
    """Consecutive entries, a new file whenever the next would pass ``limit`` bytes (as ``save_pretrained``);
    ``itemsize``: bytes per element of each tensor as written."""
    shards: list[list[tuple[str, Piece]]] = [[]]
    size = 0
    for name, piece in entries:
        nbytes = piece.numel * itemsize[name]
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, piece))
        size += nbytes
    return shards


def file_names(n: int) -> list[str]:
    """The Hub's file names of a folder of ``n`` files (``model.safetensors`` alone, as ``save_pretrained``)."""
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
