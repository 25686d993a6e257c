"""Interleaved 1F1B (pp=4, vpp=2: 8 MoE blocks, one per chunk) and 1F1B (pp=4, vpp=1: two blocks per stage, its
paired order) on 8 gloo ranks, ep=2 (dp=2), 8 micro-batches.

One spawn, two steps of each run on the same process groups:
- parameters and losses with overlap on are ``torch.equal`` to torch's own run of the schedule (overlap off);
- 1F1B's pairs per stage are those of its rule (``M - min(2 (pp - 1 - s) + 1, M)``: 1, 3, 5, 7);
- each overlapped run matches a single-process run of the unsplit stack on the same global batches: per-step
  losses within 1e-5, parameters allclose.

Eight processes on a 2-core machine: marked ``procs8`` and left out of the default run (pyproject's ``addopts``);
run it with ``python -m pytest -m procs8`` (docs/pipeline.md gives the measured time).
"""

from __future__ import annotations

import pytest
import torch

from lightning_moe_overlap.parallel import ParallelDims
from tests.helpers.distributed import mesh_groups, run_distributed
from tests.helpers.pipeline import Sizes, assert_matches_reference, bitwise_problems, train_pipeline

pytestmark = pytest.mark.procs8

WORLD = 8
VPP = {"interleaved_1f1b": 2, "1f1b": 1}
SIZES = Sizes(pp=4, ep=2, dp=2, layers=8, microbatches=8)  # M=8: every rank reaches a steady state with pairs


def worker(rank: int, world_size: int) -> dict:
    torch.use_deterministic_algorithms(True)
    groups = mesh_groups(ParallelDims.from_world_size(world_size, pp=SIZES.pp, ep=SIZES.ep), rank)
    assert (groups.dims.dp, groups.dims.ep) == (SIZES.dp, SIZES.ep), groups.dims
    runs, problems = {}, []
    for name, vpp in VPP.items():
        off = train_pipeline(groups, SIZES, name, vpp, overlap=False)
        runs[name] = train_pipeline(groups, SIZES, name, vpp, overlap=True)
        problems += bitwise_problems(f"rank {rank} {name}", runs[name], off)
    return {"runs": runs, "problems": problems, "pp_rank": groups.coords.pp}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(worker, WORLD, timeout_s=SIZES.timeout_s)


def test_pp4_overlap_bitwise_and_matches_the_unsplit_model(results: list[dict]) -> None:
    assert [r["problems"] for r in results] == [[]] * WORLD
    for name in VPP:
        assert all(r["runs"][name]["pairs"] > 0 for r in results), name  # overlapped pairs ran on every rank
        assert_matches_reference(SIZES, results, name)
    assert [r["runs"]["1f1b"]["pairs"] for r in results] == [1 + 2 * r["pp_rank"] for r in results]
