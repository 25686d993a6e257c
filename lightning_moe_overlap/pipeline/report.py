"""What a pipeline layout puts on each rank: its chunks, and the parameters each process holds.

Pure functions of the model's structure (build it on the meta device): no process group, no memory. The
``lightning-moe-overlap check`` command prints :func:`layout_report`::

    with torch.device("meta"):
        model = MoEGPT(num_layers=4)
    schedule = "interleaved_1f1b"
    split = split_model(model, build_layout(count_layers(model), pp=2, vpp=2, placement=placement_for(schedule)))
    print(layout_report(split, ep=2, schedule=schedule))
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightning_moe_overlap.config.pipeline_layout import Placement
from lightning_moe_overlap.pipeline.split import SplitModel


def placement_for(schedule: str) -> Placement:
    """The chunk placement a schedule runs: DualPipeV's V, else Megatron's interleaved (torch's loop)."""
    return "v" if schedule == "dualpipev" else "interleaved"


@dataclass(frozen=True)
class RankParameters:
    """The parameters (elements) one process of pp rank ``rank`` holds.

    Attributes:
        rank: the pp rank.
        chunks: the chunks it holds.
        dense: parameters of those chunks outside the experts (every ep rank holds them all).
        experts: this process's experts parameters: ``1/ep`` of ``experts_all``.
        experts_all: the experts parameters of those chunks, over all ep ranks together.
    """

    rank: int
    chunks: tuple[int, ...]
    dense: int
    experts: int
    experts_all: int

    @property
    def total(self) -> int:
        return self.dense + self.experts


def rank_parameters(split: SplitModel, ep: int = 1) -> list[RankParameters]:
    """Per pp rank, the parameters one of its processes holds (the experts sharded over ``ep``)."""
    from lightning_moe_overlap.moe.adapters import find_experts

    out = []
    for rank in range(split.layout.pp):
        chunks = tuple(split.chunk_indices_of_rank(rank))
        params: dict[int, nn.Parameter] = {}
        expert_ids: set[int] = set()
        for c in chunks:
            params.update((id(p), p) for p in split.chunks[c].parameters())
            for found in find_experts(split.chunks[c]).values():
                expert_ids.update(id(p) for p in found.module.parameters())
        experts_all = sum(p.numel() for i, p in params.items() if i in expert_ids)
        dense = sum(p.numel() for i, p in params.items() if i not in expert_ids)
        out.append(RankParameters(rank, chunks, dense, experts_all // ep, experts_all))
    return out


def layout_report(split: SplitModel, ep: int = 1, *, schedule: str | None = None) -> str:
    """The layout (its string and :meth:`PipelineLayout.table`) and what one process of each pp rank holds."""
    layout = split.layout
    model_total = sum(p.numel() for p in split.model.parameters())
    run = f", schedule {schedule!r}" if schedule else ""
    lines = [
        f"Pipeline: {layout.num_layers} layers in pp * vpp = {layout.pp} * {layout.vpp} = {layout.num_chunks} "
        f"chunks, placement {layout.placement!r}{run}",
        f"  pipeline_layout: {layout.to_str()!r}",
        *(f"  {line}" for line in layout.table().splitlines()),
        f"Parameters per process (experts: 1/ep of the held chunks' experts, ep={ep}):",
    ]
    for r in rank_parameters(split, ep):
        share = r.total / model_total if model_total else 0.0
        lines.append(
            f"  pp rank {r.rank}: {r.total:,} = dense {r.dense:,} + experts {r.experts:,} (of {r.experts_all:,}); "
            f"{share:.1%} of the model's {model_total:,}"
        )
    return "\n".join(lines)
