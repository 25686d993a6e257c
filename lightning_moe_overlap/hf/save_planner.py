"""A DCP ``SavePlanner`` that writes each rank's chunks under the Hub's keys: the load planner (:mod:`.planner`) run
backwards.

Each held tensor is a chunk of a model tensor (the whole tensor, or this rank's chunk of a ``DTensor`` at its global
offset). For every piece of the tensor (:mod:`.keys`) that meets the chunk, the plan has one ``WriteItem``: the file
key, the box of the file tensor it fills (``offsets`` / ``sizes``) and, resolved lazily, the view of the chunk that
holds it (cast to the export's dtype). The coordinator keeps one copy of each box that several ranks hold (replicas)
and refuses a plan that leaves part of a file tensor unwritten, so the consolidated files are whole or not written.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType

from lightning_moe_overlap.hf.keys import Piece
from lightning_moe_overlap.hf.planner import Chunk, meeting

OWNER = "`export_hf_sharded`"


@dataclass(frozen=True)
class _Box:
    view: Tensor
    dtype: torch.dtype


def _numel(sizes: tuple[int, ...] | torch.Size) -> int:
    n = 1
    for size in sizes:
        n *= size
    return n


class PieceSavePlanner(SavePlanner):
    """Plans the writes of this rank's chunks: ``set_up_planner`` gets the chunks by model name, the plan has one
    item per (piece, chunk) meeting, and each item resolves to its view of the chunk.

    Args:
        pieces: the pieces of every model tensor this rank holds (names as in the state dict given to
            ``set_up_planner``).
        dtype: the dtype floating-point tensors are written in (None: their own).
        expected: the file keys this save must write (the coordinator's check: each of them written whole).

    Attributes:
        bytes_planned: bytes of the boxes this rank writes after the coordinator dropped replicas' copies.
    """

    def __init__(
        self, pieces: Mapping[str, list[Piece]], dtype: torch.dtype | None = None, expected: Collection[str] = ()
    ) -> None:
        self.pieces = pieces
        self.dtype = dtype
        self.expected = expected
        self.chunks: dict[str, Chunk] = {}
        self.boxes: dict[tuple[str, tuple[int, ...]], _Box] = {}
        self.bytes_planned = 0

    def set_up_planner(
        self, state_dict: dict[str, Any], storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        self.chunks = dict(state_dict)

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        for name, chunk in self.chunks.items():
            dtype = self.dtype if self.dtype is not None and chunk.data.is_floating_point() else chunk.data.dtype
            for piece in self.pieces[name]:
                met = meeting(piece, chunk)
                if met is None:
                    continue
                offsets = torch.Size(met.file_offset)
                self.boxes[(piece.key, tuple(offsets))] = _Box(chunk.data[met.view], dtype)
                items.append(WriteItem(
                    index=MetadataIndex(piece.key, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets, torch.Size(met.lengths)),
                        properties=TensorProperties(dtype=dtype),
                        size=torch.Size(piece.shape),
                    ),
                ))  # fmt: skip
        return SavePlan(items)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """Each box once: a box several ranks hold (a replica's) is written by one of them, in turn, so the replicas'
        bytes are spread over their holders; every file tensor covered.

        Raises:
            ValueError: a file tensor's boxes leave part of it unwritten or overlap without being equal.
        """
        holders: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[int]] = {}
        for r, plan in enumerate(all_plans):
            for item in plan.items:
                chunk = item.tensor_data.chunk  # type: ignore[union-attr]
                holders.setdefault((item.index.fqn, tuple(chunk.offsets), tuple(chunk.sizes)), []).append(r)
        writer = {box: ranks[k % len(ranks)] for k, (box, ranks) in enumerate(holders.items())}
        plans: list[SavePlan] = []
        written: dict[str, list[WriteItem]] = {}
        for r, plan in enumerate(all_plans):
            kept = []
            for item in plan.items:
                chunk = item.tensor_data.chunk  # type: ignore[union-attr]
                if writer[(item.index.fqn, tuple(chunk.offsets), tuple(chunk.sizes))] == r:
                    kept.append(item)
                    written.setdefault(item.index.fqn, []).append(item)
            plans.append(replace(plan, items=kept))
        absent = sorted(set(self.expected) - set(written))
        if absent:
            raise ValueError(
                f"{OWNER}: no rank holds any part of {absent[:5]} ({len(absent)} key(s)). Rule: every tensor is held "
                "by some rank. Fix: call it on every rank of the run (it is collective), with each rank's own tensors."
            )
        state: dict[str, Any] = {}
        for key, items in written.items():
            data = items[0].tensor_data
            assert data is not None
            covered = sum(_numel(i.tensor_data.chunk.sizes) for i in items)  # type: ignore[union-attr]
            if covered != _numel(data.size):
                raise ValueError(
                    f"{OWNER}: the ranks' parts of {key} (shape {list(data.size)}) cover {covered} of its "
                    f"{_numel(data.size)} elements; each element must be written exactly once. Rule: every tensor is "
                    "held by some rank as a whole, a replica or disjoint shards. Fix: call it on every rank of the "
                    "run (it is collective), with each rank's own tensors."
                )
            chunks = [i.tensor_data.chunk for i in items]  # type: ignore[union-attr]
            state[key] = TensorStorageMetadata(data.properties, data.size, chunks)
        return plans, Metadata(state_dict_metadata=state)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.bytes_planned = sum(
            _numel(i.tensor_data.chunk.sizes) * i.tensor_data.properties.dtype.itemsize  # type: ignore[union-attr]
            for i in new_plan.items
        )
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> Tensor:
        """A copy of the box on the CPU, in the export's dtype: safetensors refuses tensors that share storage, and
        the boxes of one expert stack do."""
        box = self.boxes[(write_item.index.fqn, tuple(write_item.index.offset or ()))]
        view = box.view.detach()
        return torch.empty(view.shape, dtype=box.dtype, device="cpu").copy_(view)
