"""A DCP ``LoadPlanner`` that reads only the boxes of the checkpoint this rank holds.

Each held tensor is a chunk of a model tensor: the whole tensor (a plain tensor) or this rank's chunk of a
``DTensor`` at its global offset. For every piece of the tensor (:mod:`.keys`) that meets the chunk, the plan has
one ``ReadItem``: the file key, the box of the file tensor to read (``storage_offsets`` / ``lengths``) and the view
of the chunk it goes to. DCP's ``HuggingFaceStorageReader`` reads exactly that box (``get_slice(key)[box]``) and
copies it into the view (converting the dtype), so experts another rank holds are never read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.tensor import DTensor, Partial

from lightning_moe_overlap._compat import torch as torch_compat
from lightning_moe_overlap.hf.keys import Piece


@dataclass(frozen=True)
class Chunk:
    """The part of a model tensor this rank holds: ``data`` (written in place) at ``offset`` in the global tensor."""

    data: Tensor
    offset: tuple[int, ...]


def chunk_of(name: str, tensor: Tensor, shape: tuple[int, ...], owner: str) -> Chunk:
    """The writable local chunk of ``tensor`` (a parameter, buffer or ``DTensor``) of global ``shape``.

    Raises:
        ValueError: the tensor is on the meta device, or a plain tensor whose shape is not the global one.
        NotImplementedError: a ``DTensor`` with a ``Partial`` placement.
    """
    if isinstance(tensor, DTensor):
        if any(isinstance(p, Partial) for p in tensor.placements):
            raise NotImplementedError(
                f"{owner}: {name} is a DTensor with placements {tensor.placements}; a Partial placement holds a sum "
                "of parts, which a checkpoint cannot be read into. Load it as Replicate or Shard."
            )
        local_shape, offset = torch_compat.local_shape_and_offset(tensor)
        with torch.no_grad():
            data = tensor.to_local().detach()
        if tuple(data.shape) != local_shape:  # pragma: no cover - torch's own invariant
            raise RuntimeError(f"{owner}: {name}: local shard {list(data.shape)} but the layout says {local_shape}.")
    else:
        data, offset = tensor.detach(), (0,) * tensor.dim()
        if tuple(data.shape) != shape:
            raise ValueError(
                f"{owner}: {name} is a plain tensor of shape {list(data.shape)} but the model's shape of it is "
                f"{list(shape)}; a rank's part of a tensor must be a DTensor, which says where it lies. Pass the "
                "whole tensor, or the DTensor."
            )
    if data.is_meta:
        raise ValueError(
            f"{owner}: {name} is on the meta device, where nothing can be written. Allocate it first "
            "(`module.to_empty(device=...)`) or leave it out of `held` (another rank holds it)."
        )
    return Chunk(data, offset)


@dataclass(frozen=True)
class Meeting:
    """Where a piece (one file key) and a chunk (this rank's part of a model tensor) meet.

    Attributes:
        view: the index of the meeting in the chunk's local data (integer dimensions squeezed, as in the file).
        model_offset: its offset in the global model tensor.
        file_offset: its offset in the file tensor (the piece's ranges only).
        lengths: its size in the file tensor.
    """

    view: tuple[Any, ...]
    model_offset: tuple[int, ...]
    file_offset: tuple[int, ...]
    lengths: tuple[int, ...]


def meeting(piece: Piece, chunk: Chunk) -> Meeting | None:
    """Where ``piece`` and ``chunk`` meet, or None when they do not."""
    view: list[Any] = []
    model_offset: list[int] = []
    file_offset: list[int] = []
    lengths: list[int] = []
    for b, lo_local, size in zip(piece.box, chunk.offset, chunk.data.shape):
        if isinstance(b, int):
            if not lo_local <= b < lo_local + size:
                return None
            view.append(b - lo_local)
            model_offset.append(b)
            continue
        lo, hi = max(b[0], lo_local), min(b[1], lo_local + size)
        if lo >= hi:
            return None
        view.append(slice(lo - lo_local, hi - lo_local))
        model_offset.append(lo)
        file_offset.append(lo - b[0])
        lengths.append(hi - lo)
    return Meeting(tuple(view), tuple(model_offset), tuple(file_offset), tuple(lengths))


def read_items(name: str, pieces: list[Piece], chunk: Chunk) -> list[tuple[ReadItem, Tensor]]:
    """One ``ReadItem`` (and its destination view) per piece that meets ``chunk``."""
    out: list[tuple[ReadItem, Tensor]] = []
    for piece in pieces:
        met = meeting(piece, chunk)
        if met is None:
            continue
        item = ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=MetadataIndex(name, torch.Size(met.model_offset)),
            dest_offsets=torch.Size(met.model_offset),
            storage_index=MetadataIndex(piece.key, torch.Size([0] * len(piece.shape))),
            storage_offsets=torch.Size(met.file_offset),
            lengths=torch.Size(met.lengths),
        )
        out.append((item, chunk.data[met.view]))
    return out


class PieceLoadPlanner(LoadPlanner):
    """Plans the reads of this rank's chunks: ``set_up_planner`` gets the chunks by model name, the plan has one
    item per (piece, chunk) intersection, and each item resolves to its view of the chunk.

    Args:
        pieces: the pieces of every model tensor (names as in the state dict given to ``set_up_planner``).
    """

    def __init__(self, pieces: Mapping[str, list[Piece]]) -> None:
        self.pieces = pieces
        self.chunks: dict[str, Chunk] = {}
        self.views: dict[tuple[str, tuple[int, ...]], Tensor] = {}
        self.committed: list[ReadItem] = []

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        self.chunks = dict(state_dict)

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for name, chunk in self.chunks.items():
            for item, view in read_items(name, self.pieces[name], chunk):
                self.views[_key(item)] = view
                items.append(item)
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan  # each rank reads its own boxes; nothing to coordinate

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:  # pragma: no cover - HF files hold tensors only
        raise RuntimeError(f"`PieceLoadPlanner`: {read_item.dest_index.fqn} is not a tensor; HF files hold tensors.")

    def resolve_tensor(self, read_item: ReadItem) -> Tensor:
        return self.views[_key(read_item)]

    def commit_tensor(self, read_item: ReadItem, tensor: Tensor) -> None:
        self.committed.append(read_item)  # the reader copied into the view itself: nothing to write back


def _key(item: ReadItem) -> tuple[str, tuple[int, ...]]:
    return item.dest_index.fqn, tuple(item.dest_offsets)
