"""``MoEOverlapStrategy(pp=2, vpp=2, cp=2, ep=2)`` on 8 gloo ranks: dp=2 beside cp=2 in each stage, so the gradients
are averaged over dp x cp (4 ranks) and each dp rank's cp pair shares its own sequences, which the 4-rank test
(dp=1) does not reach; with ``shard="full"`` the chunks are sharded over those 4 ranks.

Oracles (the 4-rank test's, ``test_pipeline_context_parallel.py``): one process training the unsplit ``MoEGPT`` on the
same global batches (per dp rank the mean over its cp ranks of each step's loss, and every parameter of the
consolidated state, within 1e-5), and the overlapped schedule bitwise equal to the sequential one.

Eight processes on a 2-core machine: marked ``procs8`` and left out of the default run (``python -m pytest -m
procs8``).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_pipeline_context_parallel import CP, fit
from tests.distributed.test_pipeline_tensor_parallel import STEPS, M, reference
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.procs8

WORLD, PP = 8, 2
DP = WORLD // (PP * CP)
RUNS = (("on", "none", True), ("off", "none", False), ("full", "full", True))


def worker(rank: int, world: int) -> dict:
    torch.use_deterministic_algorithms(True)
    return {name: fit("gpt", PP, shard, overlap, {}, world=WORLD) for name, shard, overlap in RUNS}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(worker, WORLD, timeout_s=600)


@pytest.mark.parametrize("name", ["on", "full"])
def test_pp2_cp2_dp2_matches_one_process(results: list[dict], name: str) -> None:
    """``"full"`` too, but not bitwise ``"none"``: over 4 ranks its reduce-scatter sums in another order than the
    replicas' all-reduce (over 2, as in the 4-rank test, the order does not matter)."""
    ref_losses, ref_state = reference("gpt", DP, M // DP)
    for d in range(DP):
        shares = [runs[name]["losses"] for runs in results if runs[name]["dp"] == d]
        assert len(shares) == WORLD // DP and all(len(s) == STEPS for s in shares), d
        for step, want in enumerate(ref_losses[d]):
            assert abs(sum(s[step] for s in shares) / len(shares) - want) < 1e-5, (name, d, step)
    state = results[0][name]["full"]
    assert set(state) == set(ref_state)
    for key, want in ref_state.items():
        torch.testing.assert_close(state[key], want, rtol=1e-5, atol=1e-5, msg=f"{name} {key}")


def test_overlap_equals_sequential_bitwise(results: list[dict]) -> None:
    for rank, runs in enumerate(results):
        assert runs["on"]["losses"] == runs["off"]["losses"], rank
    on, off = results[0]["on"]["full"], results[0]["off"]["full"]
    assert on.keys() == off.keys() and all(torch.equal(on[key], off[key]) for key in on)
