"""``MoEOverlapStrategy(pp=2, vpp=2, ep=2, delay_wgrad=True)`` on 4 gloo ranks (dp=2 per stage), under interleaved
1F1B (overlapped), DualPipeV (overlapped), zero-bubble and 1F1B (vpp=1, its paired order, overlapped): the experts'
weight-gradient GEMMs are queued during each stage backward, run at its comm points, and what is left is the
stage's weight work, run at the end of a full backward or in the schedule's weight action (``W``) after a split one.

Oracles, from one spawn:
- a count of what ran (a counter installed at test time around the wgrad GEMM and what the runtime queues, and
  around torch's weight action): every GEMM from the queue, none inline, steps x micro-batches x held MoE layers x 2
  per rank (and those of torch's metadata inference at the first step); inside the weight actions for the split
  schedules, none there for interleaved 1F1B;
- the same run with ``delay_wgrad=False``: the losses and the consolidated state bitwise equal (and under
  zero-bubble with ``shard="full"`` and ``overlap_grad_reduce``);
- one process training the unsplit model (``test_pipeline_sharded.reference``): losses and parameters within 1e-5;
- the same for HF Qwen3-MoE and DeepSeek-V3 (its correction bias) under interleaved 1F1B, overlapped: every GEMM
  queued, bitwise ``delay_wgrad=False``, within 1e-5 of one process training HF's model with HF's loss.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch.distributed.pipelining import PipelineStage

from lightning_moe_overlap.moe import grouped
from tests.distributed.test_delay_wgrad_strategy import WgradCounter
from tests.distributed.test_pipeline_sharded import GPT, PP, STEPS, WORLD, M, fit, reference
from tests.helpers.distributed import run_distributed
from tests.helpers.runs import assert_same_training

SCHEDULES = {"interleaved_1f1b": True, "dualpipev": True, "zero_bubble": False, "1f1b": True}  # schedule: overlap
SPLIT = ("dualpipev", "zero_bubble")  # schedules with weight actions
HF = ("qwen3", "deepseek")  # HF Qwen3-MoE and DeepSeek-V3 (its correction bias) under interleaved 1F1B
GEMMS_PER_RANK = STEPS * M * (GPT["num_layers"] // PP) * 2  # fc1 and fc2 of each held MoE layer, every micro-batch


class InWeightAction:
    """Counts the wgrad GEMMs that run inside torch's weight action (``backward_weight_one_chunk``); install it
    inside ``WgradCounter.installed()``, around the counter's own wrapper."""

    def __init__(self) -> None:
        self.count = 0
        self._inside = threading.local()

    @contextmanager
    def installed(self) -> Iterator[InWeightAction]:
        original_weight, original_wgrad = PipelineStage.backward_weight_one_chunk, grouped._wgrad
        watch = self

        def weight_action(stage, *args, **kwargs):
            watch._inside.active = True
            try:
                return original_weight(stage, *args, **kwargs)
            finally:
                watch._inside.active = False

        def counted(*args, **kwargs):
            if getattr(watch._inside, "active", False):
                watch.count += 1
            return original_wgrad(*args, **kwargs)

        PipelineStage.backward_weight_one_chunk, grouped._wgrad = weight_action, counted
        try:
            yield self
        finally:
            PipelineStage.backward_weight_one_chunk, grouped._wgrad = original_weight, original_wgrad


def worker(rank: int, world: int) -> dict:
    torch.use_deterministic_algorithms(True)
    out: dict = {}
    for schedule, overlap in SCHEDULES.items():
        settings = {"pipeline_schedule": schedule, **({"vpp": 1} if schedule == "1f1b" else {})}
        out[f"{schedule}-off"] = fit("gpt", "none", overlap, {**settings, "delay_wgrad": False})
        counter = WgradCounter()
        with counter.installed(), InWeightAction().installed() as weight:
            run = fit("gpt", "none", overlap, {**settings, "delay_wgrad": True})
        out[schedule] = {**run, "queued": counter.queued, "inline": counter.inline, "in_weight": weight.count}
    sharded = {"pipeline_schedule": "zero_bubble", "delay_wgrad": True, "overlap_grad_reduce": True}
    out["zero_bubble-full"] = fit("gpt", "full", False, sharded)  # the weight actions inside the sharded step
    return out


def hf_worker(rank: int, world: int) -> dict:
    """The HF families under interleaved 1F1B, overlapped, delay on and off."""
    torch.use_deterministic_algorithms(True)
    out: dict = {}
    for kind in HF:
        out[f"{kind}-off"] = fit(kind, "none", True, {"delay_wgrad": False})
        counter = WgradCounter()
        with counter.installed():
            out[kind] = {**fit(kind, "none", True, {"delay_wgrad": True}), "queued": counter.queued,
                         "inline": counter.inline}  # fmt: skip
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(worker, WORLD, timeout_s=400)


@pytest.fixture(scope="module")
def hf_results() -> list[dict]:
    return run_distributed(hf_worker, WORLD, timeout_s=400)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_every_expert_wgrad_gemm_is_queued_and_split_schedules_run_them_in_the_weight_action(
    results: list[dict], schedule: str
) -> None:
    for rank, runs in enumerate(results):
        run = runs[schedule]
        # torch's metadata inference at the first step runs one real backward per held stage: at most one more GEMM
        # per held layer and projection, queued like the others
        inference = (GPT["num_layers"] // PP) * 2
        assert GEMMS_PER_RANK <= run["queued"] <= GEMMS_PER_RANK + inference, (rank, run["queued"])
        assert run["inline"] == 0, (rank, run["inline"])
        if schedule in SPLIT:
            assert 0 < run["in_weight"] <= GEMMS_PER_RANK, (rank, run["in_weight"])
        else:
            assert run["in_weight"] == 0, (rank, run["in_weight"])


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_delayed_wgrad_is_bitwise_the_plain_backward_and_matches_one_process(
    results: list[dict], schedule: str
) -> None:
    assert_same_training(results, [(schedule, f"{schedule}-off")])
    if schedule == "zero_bubble":  # shard="full" with the early reduction: over 2 dp ranks, bitwise "none"
        assert_same_training(results, [("zero_bubble-full", schedule)])
    _matches_one_process(results, schedule, "gpt")


@pytest.mark.long
@pytest.mark.parametrize("kind", HF)
def test_hugging_face_families_delay_bitwise_and_match_one_process(hf_results: list[dict], kind: str) -> None:
    for rank, runs in enumerate(hf_results):
        assert runs[kind]["queued"] > 0 and runs[kind]["inline"] == 0, (rank, runs[kind]["queued"])
    assert_same_training(hf_results, [(kind, f"{kind}-off")])
    _matches_one_process(hf_results, kind, kind)


def _matches_one_process(results: list[dict], run: str, kind: str) -> None:
    """Run ``run``'s per-step losses and final parameters within 1e-5 of one process training ``kind``."""
    ref_losses, ref_state = reference(kind)
    for rank, runs in enumerate(results):
        want = ref_losses[runs[run]["coords"][1]]
        assert all(abs(g - w) < 1e-5 for g, w in zip(runs[run]["losses"], want, strict=True)), rank
    full = results[0][run]["full"]
    for key, want in ref_state.items():
        torch.testing.assert_close(full[key], want, rtol=1e-5, atol=1e-5, msg=f"{run} {key}")
