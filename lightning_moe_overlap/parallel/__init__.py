"""Parallel sizes, rank layout, process groups and the device mesh."""

from lightning_moe_overlap.parallel.dims import ParallelDims, ParallelDimsError, RankCoords
from lightning_moe_overlap.parallel.groups import ParallelGroups
from lightning_moe_overlap.parallel.mesh import MeshLayout, ParallelMesh, build_mesh, mesh_layout

__all__ = [
    "MeshLayout",
    "ParallelDims",
    "ParallelDimsError",
    "ParallelGroups",
    "ParallelMesh",
    "RankCoords",
    "build_mesh",
    "mesh_layout",
]
