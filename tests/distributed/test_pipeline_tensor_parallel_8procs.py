"""``MoEOverlapStrategy(pp=2, vpp=2, tp=2, ep=2, shard="full")`` on 8 gloo ranks: each stage's chunks tensor-parallel
over tp=2 and ``fully_shard``-ed over its dp=2 ranks (2-D: dp x tp), which the 4-rank test (dp=1) does not reach.

Oracles (the 4-rank test's, ``test_pipeline_tensor_parallel.py``): one process training the unsplit ``MoEGPT`` on the
same global batches (per-step losses and every parameter of the consolidated state within 1e-5), and the overlapped
schedule with ``overlap_grad_reduce`` bitwise equal to the sequential one without it.

Eight processes on a 2-core machine: marked ``procs8`` and left out of the default run (``python -m pytest -m
procs8``).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_pipeline_tensor_parallel import STEPS, TP, M, fit, reference
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.procs8

WORLD, PP = 8, 2
DP = WORLD // (PP * TP)


def worker(rank: int, world: int) -> dict:
    torch.use_deterministic_algorithms(True)
    return {
        name: fit("gpt", PP, "full", overlap, {"overlap_grad_reduce": early}, world=WORLD)
        for name, overlap, early in (("on", True, True), ("off", False, False))
    }


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(worker, WORLD, timeout_s=600)


def test_pp2_tp2_dp2_sharded_matches_one_process_and_overlap_is_bitwise(results: list[dict]) -> None:
    ref_losses, ref_state = reference("gpt", DP, M // DP)
    assert sorted({runs["on"]["dp"] for runs in results}) == list(range(DP))
    for rank, runs in enumerate(results):
        assert runs["on"]["losses"] == runs["off"]["losses"], rank
        want = ref_losses[runs["on"]["dp"]]
        assert len(want) == STEPS and all(abs(g - w) < 1e-5 for g, w in zip(runs["on"]["losses"], want)), rank
    on, off = results[0]["on"]["full"], results[0]["off"]["full"]
    assert set(on) == set(ref_state)
    for key, want in ref_state.items():
        assert torch.equal(on[key], off[key]), key
        torch.testing.assert_close(on[key], want, rtol=1e-5, atol=1e-5, msg=key)
