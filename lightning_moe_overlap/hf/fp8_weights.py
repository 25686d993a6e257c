"""FP8 checkpoints with block scales (DeepSeek-V3's published files), dequantised into the model's dtype as read.

Such a checkpoint stores a linear weight ``W [R, C]`` as ``float8_e4m3fn`` with a companion ``W_scale_inv``
(float32, one value per ``b0 x b1`` block, ``config.json``'s ``quantization_config.weight_block_size``, 128 x 128
for DeepSeek-V3): the real weight is each block's values times its scale, and the scale grid has
``ceil(R / b0) x ceil(C / b1)`` values (the last blocks of a dimension may be partial)::

    W_real[r, c] = W[r, c] * W_scale_inv[r // b0, c // b1]

The mode is on when ``config.json`` declares ``quantization_config.quant_method == "fp8"`` or the files hold a
``*_scale_inv`` key. Then, from the headers alone (:func:`split_scales`), every scale is checked against its weight
and taken out of the keys the model is matched against (so it is consumed, not unexpected). At read time
(:class:`BlockScaledPlanner`), each box of an FP8 weight a rank reads gets a second read: the blocks of its scale
that cover the box, into a small float32 buffer. The weight's box is copied into the held tensor (FP8 values are
exact in bf16 and fp32) and, once both reads are in, multiplied in place by its blocks' scales, one row of blocks at
a time (the product in float32, stored in the model's dtype: ``(W.float() * scale).to(dtype)``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from lightning_moe_overlap.hf.files import FileTensor
from lightning_moe_overlap.hf.keys import Piece
from lightning_moe_overlap.hf.planner import PieceLoadPlanner

SUFFIX = "_scale_inv"
DEFAULT_BLOCK = (128, 128)  # FineGrainedFP8Config's default, DeepSeek-V3's size
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SHOWN = 12  # problems listed in one error


@dataclass(frozen=True)
class BlockScales:
    """The FP8 weights of a checkpoint and their scales.

    Attributes:
        block: the rows and columns of a weight one scale value covers.
        scales: FP8 weight key -> its ``_scale_inv`` key.
    """

    block: tuple[int, int]
    scales: Mapping[str, str]


def split_scales(
    config: Mapping[str, Any], files: Mapping[str, FileTensor], owner: str
) -> tuple[dict[str, FileTensor], BlockScales | None]:
    """The keys the model is matched against (the ``_scale_inv`` companions taken out) and the block scales, or
    ``(files, None)`` when the checkpoint is not block-scaled FP8. Headers only.

    Raises:
        ValueError: ``weight_block_size`` is not two positive integers, or a weight and its scale do not fit: a
            scale without an FP8 weight, an FP8 weight without a scale, a scale that is not floating point or whose
            shape is not ``ceil(weight shape / block)``.
        NotImplementedError: an FP8 weight with a scale is not 2-D.
    """
    declared = config.get("quantization_config") or {}
    fp8 = declared.get("quant_method") == "fp8" if isinstance(declared, Mapping) else False
    companions = sorted(k for k in files if k.endswith(SUFFIX))
    if not fp8 and not companions:
        return dict(files), None
    block = _block(declared if fp8 else {}, owner)
    scales = {k[: -len(SUFFIX)]: k for k in companions}
    _check(files, scales, block, owner)
    taken = set(companions)
    return {k: f for k, f in files.items() if k not in taken}, BlockScales(block, scales)


def _block(declared: Mapping[str, Any], owner: str) -> tuple[int, int]:
    size = declared.get("weight_block_size", DEFAULT_BLOCK)
    ok = isinstance(size, (list, tuple)) and len(size) == 2
    if not ok or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in size):
        raise ValueError(
            f"{owner}: config.json has quantization_config.weight_block_size={size!r}. Rule: block-scaled FP8 weights "
            "have one scale per block of [rows, columns], two positive integers ([128, 128] for DeepSeek-V3). Fix: "
            "set it to the block size the checkpoint was quantised with."
        )
    return int(size[0]), int(size[1])


def _check(files: Mapping[str, FileTensor], scales: Mapping[str, str], block: tuple[int, int], owner: str) -> None:
    problems: list[str] = []
    not_2d: list[str] = []
    for weight, scale in sorted(scales.items()):
        w, s = files.get(weight), files[scale]
        if w is None or w.dtype not in FP8_DTYPES:
            kind = "absent" if w is None else f"{w.dtype}, not FP8"
            problems.append(f"{scale} {list(s.shape)}: its weight {weight} is {kind}")
            continue
        if len(w.shape) != 2:
            not_2d.append(f"{weight} {list(w.shape)}")
            continue
        grid = scale_grid(w.shape, block)
        if s.shape != grid:
            problems.append(
                f"{scale}: shape {list(s.shape)}, but {weight} {list(w.shape)} in blocks of {list(block)} needs "
                f"{list(grid)}{_implied(w.shape, s.shape, block)}"
            )
        elif not s.dtype.is_floating_point:
            problems.append(f"{scale}: dtype {s.dtype}, not a floating-point scale")
    orphans = [f"{k} {list(f.shape)}: FP8 with no {k}{SUFFIX}" for k, f in files.items() if _bare(k, f, scales)]
    problems += sorted(orphans)
    if not_2d:
        raise NotImplementedError(
            f"{owner}: block-scaled FP8 weights that are not 2-D: {not_2d[:SHOWN]}. Rule: a `{SUFFIX}` scale covers "
            "a matrix in blocks of [rows, columns]. Fix: store these weights in high precision, or one matrix per key."
        )
    if problems:
        more = f"\n    ... and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
        raise ValueError(
            f"{owner}: the checkpoint's FP8 weights and their scales do not fit (block size {list(block)}):\n"
            + "\n".join(f"    {p}" for p in problems[:SHOWN]) + more
            + f"\nRule: each FP8 weight W [R, C] has a floating-point W{SUFFIX} of shape [ceil(R / b0), ceil(C / b1)] "
            "with [b0, b1] = config.json's quantization_config.weight_block_size (default [128, 128]), and each "
            f"`{SUFFIX}` key has such a weight. Fix: set weight_block_size to the block size the checkpoint was "
            "quantised with, or load the checkpoint's complete, unmodified files (docs/hf_checkpoints.md)."
        )  # fmt: skip


def _bare(key: str, f: FileTensor, scales: Mapping[str, str]) -> bool:
    return f.dtype in FP8_DTYPES and key not in scales


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """``ceil(shape / block)``: the scale values of a weight of ``shape`` (the last blocks may be partial)."""
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def _implied(shape: tuple[int, ...], grid: tuple[int, ...], block: tuple[int, int]) -> str:
    """A block size the scale's shape fits, where there is one: per dimension ``block``'s own where it fits, else
    the largest power of two among the sizes that fit (for one block: the power of two at or above the dimension),
    else the smallest of them."""
    if len(grid) != 2 or not all(0 < g <= n for g, n in zip(grid, shape)):
        return ""
    implied = []
    for n, g, b in zip(shape, grid, block):
        # every size in [lo, hi] fits; one block (g = 1) fits any size >= n: up to the power of two at or above n
        lo, hi = math.ceil(n / g), (n - 1) // (g - 1) if g > 1 else max(n, b, 1 << (n - 1).bit_length())
        if lo > hi:  # no block size gives g blocks of n
            return ""
        powers = [2**k for k in range(hi.bit_length()) if lo <= 2**k <= hi]
        implied.append(b if lo <= b <= hi else (powers[-1] if powers else lo))
    return f" (it fits blocks of {implied}: was it quantised with another block size?)"


def scale_read(item: ReadItem, scale_key: str, block: tuple[int, int]) -> tuple[ReadItem, Tensor]:
    """The read of the scale blocks that cover a weight read ``item`` (its box of the file's 2-D weight), and the
    float32 buffer it fills."""
    (r0, c0), (rows, cols) = item.storage_offsets, item.lengths
    first = (r0 // block[0], c0 // block[1])
    last = ((r0 + rows - 1) // block[0], (c0 + cols - 1) // block[1])
    lengths = torch.Size([last[0] - first[0] + 1, last[1] - first[1] + 1])
    where = torch.Size(item.dest_offsets)
    read = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(f"{item.dest_index.fqn}<-{scale_key}", where),
        dest_offsets=where,
        storage_index=MetadataIndex(scale_key, torch.Size([0, 0])),
        storage_offsets=torch.Size(first),
        lengths=lengths,
    )
    return read, torch.empty(lengths, dtype=torch.float32)


def apply_scales(view: Tensor, scales: Tensor, offsets: tuple[int, int], block: tuple[int, int]) -> None:
    """Multiply ``view`` (a box of a weight at ``offsets`` in the file tensor, holding its FP8 values) in place by
    ``scales`` (the scale blocks covering the box, from the block of ``offsets``), one row of blocks at a time."""
    rows, cols = view.shape
    lead = (offsets[0] % block[0], offsets[1] % block[1])  # the box's start inside its first block
    per_column = scales.repeat_interleave(block[1], dim=1)[:, lead[1] : lead[1] + cols]  # [row blocks, cols]
    with torch.no_grad():
        for i in range(scales.shape[0]):
            start = max(i * block[0] - lead[0], 0)
            stop = min((i + 1) * block[0] - lead[0], rows)
            view[start:stop].mul_(per_column[i])


class BlockScaledPlanner(PieceLoadPlanner):
    """:class:`~.planner.PieceLoadPlanner` that also reads the scale blocks of every FP8 weight box and dequantises
    the box in place once both reads are in (in whichever order the reader commits them)."""

    def __init__(self, pieces: Mapping[str, list[Piece]], scales: BlockScales) -> None:
        super().__init__(pieces)
        self.scales = scales
        self.partner: dict[tuple[str, tuple[int, ...]], tuple[ReadItem, ReadItem]] = {}
        self.arrived: set[tuple[str, tuple[int, ...]]] = set()

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        extra: list[ReadItem] = []
        for item in plan.items:
            scale_key = self.scales.scales.get(item.storage_index.fqn)
            if scale_key is None:
                continue
            read, buffer = scale_read(item, scale_key, self.scales.block)
            self.views[_key(read)] = buffer
            self.partner[_key(item)] = self.partner[_key(read)] = (item, read)
            extra.append(read)
        return LoadPlan([*plan.items, *extra])

    def commit_tensor(self, read_item: ReadItem, tensor: Tensor) -> None:
        key = _key(read_item)
        if key in self.partner:
            weight, scale = self.partner[key]
            other = _key(scale) if key == _key(weight) else _key(weight)
            if other not in self.arrived:
                self.arrived.add(key)
            else:
                self.arrived.discard(other)
                offsets = (weight.storage_offsets[0], weight.storage_offsets[1])
                apply_scales(self.views[_key(weight)], self.views[_key(scale)], offsets, self.scales.block)
        super().commit_tensor(read_item, tensor)


def _key(item: ReadItem) -> tuple[str, tuple[int, ...]]:
    return item.dest_index.fqn, tuple(item.dest_offsets)
