"""``MoEOverlapStrategy(pp=2, vpp=2, ep=2, shard="full")`` on 8 gloo ranks: each stage has dp=4 and edp=2, so at
``pp > 1`` the experts are sharded over their expert-data-parallel ranks too (2-D over ``(edp, ep)``), which the
4-rank test (edp=1) does not reach.

Oracles (the 4-rank test's, ``test_pipeline_sharded.py``): one process training the unsplit ``MoEGPT`` on the same
global batches (per-step losses and every parameter of the consolidated state within 1e-5), the overlapped schedule
bitwise equal to the sequential one, and each rank's experts held as ``E / (edp * ep)`` experts' rows.

Eight processes on a 2-core machine: marked ``procs8`` and left out of the default run (``python -m pytest -m
procs8``).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_pipeline_sharded import EP, STEPS, fit, reference
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.procs8

WORLD, DP, M = 8, 4, 2  # per stage: 4 dp ranks, 2 samples each per step (G = 8), 2 micro-batches of one sample


def worker(rank: int, world: int) -> dict:
    torch.use_deterministic_algorithms(True)
    return {
        name: fit("gpt", "full", overlap, {"overlap_grad_reduce": early}, world=WORLD, micro=M)
        for name, overlap, early in (("on", True, True), ("off", False, False))
    }


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(worker, WORLD, timeout_s=600)


def test_experts_sharded_over_edp_at_pp2_match_one_process_and_overlap_is_bitwise(results: list[dict]) -> None:
    ref_losses, ref_state = reference("gpt", dp=DP, micro=M)
    for rank, runs in enumerate(results):
        assert runs["on"]["losses"] == runs["off"]["losses"], rank
        want = ref_losses[runs["on"]["coords"][1]]
        assert len(want) == STEPS and all(abs(g - w) < 1e-5 for g, w in zip(runs["on"]["losses"], want)), rank
        experts = [layout for layout in runs["on"]["optimizer"] if len(layout[3]) == 3]  # MoEGPT's experts: 3-D
        assert experts, rank
        for placements, mesh_shape, local, full in experts:  # (edp, ep) = (2, 2): a quarter of the experts' rows
            assert mesh_shape == (DP // EP, EP) and local[0] * DP == full[0], (rank, placements, local, full)
    on, off = results[0]["on"]["full"], results[0]["off"]["full"]
    for key, want in ref_state.items():
        assert torch.equal(on[key], off[key]), key
        torch.testing.assert_close(on[key], want, rtol=1e-5, atol=1e-5, msg=key)
