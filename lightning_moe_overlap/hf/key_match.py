"""Match a model against a checkpoint's keys before anything is read: nothing may stay silently at its init.

From the files' keys and shapes and the model's global shapes only (so every rank reaches the same answer), each
model tensor gets the pieces that fill it, from the first candidate whose keys all exist with the right shapes:

1. the family's pieces (:mod:`.keys`);
2. the tensor's own name as one key (transformers v5's fused keys; the ``identity`` family);
3. with ``tie_word_embeddings``, the pieces of the tensor it is tied to (``HFFamily.ties``).

Then every element of every model tensor must be covered exactly once, and every key of the files used (or matched
by ``ignore``). Otherwise :class:`HFKeysError` names, in one message, the missing keys (grouped by their numbers,
e.g. the experts), the unexpected keys, the shape mismatches and any tensor the family's pieces do not cover.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping, Sequence

import torch

from lightning_moe_overlap.hf.files import FileTensor
from lightning_moe_overlap.hf.keys import HFFamily, Piece, whole

SHOWN = 12  # lines per kind of problem in the message


class HFKeysError(ValueError):
    """The checkpoint does not fill the model exactly (missing, unexpected or misshapen keys)."""


def plan_pieces(
    shapes: Mapping[str, Sequence[int]],
    files: Mapping[str, FileTensor],
    family: HFFamily,
    *,
    tied: bool,
    ignore: Sequence[str] = (),
    where: str,
    owner: str,
) -> dict[str, list[Piece]]:
    """The pieces of every tensor of ``shapes`` (names as the HF model has them).

    Raises:
        HFKeysError: a tensor is not covered by keys that exist with their shapes, or a key is not used.
    """
    ties = dict(family.ties) if tied else {}
    plan: dict[str, list[Piece]] = {}
    missing: set[str] = set()
    mismatched: dict[str, str] = {}
    uncovered: list[str] = []
    claimed: set[str] = set()  # keys of the tensors that failed: named in their own problem, not as unexpected
    for name, raw in shapes.items():
        shape = tuple(int(s) for s in raw)
        candidates = _candidates(family, name, shape, ties.get(name))
        chosen = next((c for c in candidates if c is not None and _fits(c, files)), None)
        if chosen is None:
            claimed |= _diagnose(name, shape, candidates, files, missing, mismatched)
            continue
        if not covers(chosen, shape):
            uncovered.append(f"{name} {list(shape)}: pieces {[(p.key, p.box) for p in chosen][:4]}...")
            claimed |= {p.key for p in chosen}
            continue
        plan[name] = chosen
    used = claimed | {p.key for pieces in plan.values() for p in pieces}
    skip = [re.compile(p) for p in ignore]
    unexpected = sorted(k for k in files if k not in used and not any(s.search(k) for s in skip))
    if missing or unexpected or mismatched or uncovered:
        raise HFKeysError(_message(owner, where, family, sorted(missing), unexpected, mismatched, uncovered))
    return plan


def _candidates(family: HFFamily, name: str, shape: tuple[int, ...], tie: str | None) -> list[list[Piece] | None]:
    out = [family.pieces(name, shape), [whole(name, shape)]]
    if tie is not None:
        out += [family.pieces(tie, shape), [whole(tie, shape)]]
    return out


def _fits(pieces: list[Piece], files: Mapping[str, FileTensor]) -> bool:
    return all(p.key in files and files[p.key].shape == p.shape for p in pieces)


def _diagnose(
    name: str,
    shape: tuple[int, ...],
    candidates: list[list[Piece] | None],
    files: Mapping[str, FileTensor],
    missing: set[str],
    mismatched: dict[str, str],
) -> set[str]:
    """Record why no candidate fits: the shapes of the first candidate whose keys all exist, else the absent keys of
    the candidate with the most keys present (the family's own on a tie). Returns the keys of the files that
    candidate names."""
    for pieces in candidates:
        if pieces is not None and all(p.key in files for p in pieces):
            for p in pieces:
                if files[p.key].shape != p.shape:
                    mismatched[p.key] = f"file {list(files[p.key].shape)}, {name} {list(shape)} needs {list(p.shape)}"
            return {p.key for p in pieces}
    if candidates[0] is None:  # the family cannot cut this shape at all
        mismatched[name] = f"model shape {list(shape)} cannot be cut into the family's parts"
        return set()
    best = max((c for c in candidates if c is not None), key=lambda c: sum(p.key in files for p in c))
    missing.update(p.key for p in best if p.key not in files)
    return {p.key for p in best if p.key in files}


def covers(pieces: list[Piece], shape: tuple[int, ...]) -> bool:
    """Every element of a tensor of ``shape`` lies in exactly one piece's box (checked on the grid of the boxes'
    edges, so the cost depends on the number of pieces, not on the tensor's size)."""
    if any(len(p.box) != len(shape) for p in pieces):
        return False
    cuts = [sorted({0, size} | {e for p in pieces for e in _range(p.box[d])}) for d, size in enumerate(shape)]
    if any(c[0] < 0 or c[-1] > size for c, size in zip(cuts, shape)):
        return False
    if any(size == 0 for size in shape):
        return True
    counts = torch.zeros([len(c) - 1 for c in cuts], dtype=torch.int32)
    for p in pieces:
        index = tuple(slice(c.index(lo), c.index(hi)) for c, (lo, hi) in zip(cuts, (_range(b) for b in p.box)))
        counts[index] += 1
    return bool((counts == 1).all())


def _range(b: int | tuple[int, int]) -> tuple[int, int]:
    return (b, b + 1) if isinstance(b, int) else b


def group_keys(keys: Sequence[str]) -> list[str]:
    """Keys that differ only in their last number, as one line: ``a.experts.{3,5-7}.w1.weight``."""
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    singles: list[str] = []
    for key in keys:
        parts = key.split(".")
        at = next((i for i in range(len(parts) - 1, -1, -1) if parts[i].isdigit()), None)
        if at is None:
            singles.append(key)
            continue
        groups[(".".join(parts[:at]), ".".join(parts[at + 1 :]))].append(int(parts[at]))
    lines = [f"{head}.{{{_ranges(sorted(n))}}}" + (f".{tail}" if tail else "") for (head, tail), n in groups.items()]
    return sorted(lines + singles)


def _ranges(numbers: list[int]) -> str:
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _section(title: str, lines: list[str]) -> str:
    shown = "\n".join(f"    {line}" for line in lines[:SHOWN])
    more = f"\n    ... and {len(lines) - SHOWN} more" if len(lines) > SHOWN else ""
    return f"\n  {title}:\n{shown}{more}"


def _message(
    owner: str,
    where: str,
    family: HFFamily,
    missing: list[str],
    unexpected: list[str],
    mismatched: dict[str, str],
    uncovered: list[str],
) -> str:
    text = f"{owner}: the checkpoint {where} does not fill the model exactly (key family {family.name!r})."
    if missing:
        text += _section(f"missing keys ({len(missing)}; their tensors would stay at their init)", group_keys(missing))
    if unexpected:
        title = f"unexpected keys ({len(unexpected)}; no tensor of the model takes them)"
        text += _section(title, group_keys(unexpected))
    if mismatched:
        text += _section(f"shape mismatches ({len(mismatched)})", [f"{k}: {v}" for k, v in sorted(mismatched.items())])
    if uncovered:
        text += _section(f"tensors the family's pieces do not cover exactly once ({len(uncovered)})", uncovered)
    return (
        text + "\nRule: every element of every parameter and persistent buffer is read from the checkpoint, and every "
        "key of the checkpoint is used. Fix: load a checkpoint of this model's architecture and config (its "
        "config.json sizes must equal the model's), pass `family=` the key layout of the files (or register one "
        "with `register_hf_family`), or pass `ignore=` patterns for keys to leave out (docs/hf_checkpoints.md)."
    )
