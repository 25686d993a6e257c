"""Parallel sizes, rank layout and process groups."""

from lightning_moe_overlap.parallel.dims import ParallelDims, ParallelDimsError, RankCoords
from lightning_moe_overlap.parallel.groups import ParallelGroups, build_groups

__all__ = ["ParallelDims", "ParallelDimsError", "ParallelGroups", "RankCoords", "build_groups"]
