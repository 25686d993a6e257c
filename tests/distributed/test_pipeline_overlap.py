"""Pipeline schedules with the overlapped pair on 4 gloo ranks: pp=2 x ep=2 (dp=2), chunks of MoE blocks.

One spawn runs every check on the same process groups:
- interleaved 1F1B (vpp=2) and DualPipeV: parameters after the steps with overlap on are ``torch.equal`` to the
  same schedule run by torch alone (overlap off);
- the same two schedules with each memory callback attached to every rank's chunks (``callback.apply(chunks)``):
  selective recompute (the routed experts, whose recomputation re-runs their all-to-alls inside the backward
  context, and the experts' activation nested in it), full-layer recompute, activation offload. One step each;
  with overlap on and off, parameters and losses are ``torch.equal`` to each other and to the run without the
  callback, and the callback did act (recomputations ran, tensors moved to the host and back);
- those runs and plain 1F1B (vpp=1) match a single-process run of the unsplit stack on the same global batches:
  per-step losses within 1e-5, parameters allclose;
- last, rank 3 raises inside a stage's forward during an overlapped pair: every rank ends, before the process-group
  timeout, rank 3 with its own error and the others with a ``PeerFailure`` naming it.

The model, the training run and the reference are in tests/helpers/pipeline.py; the 8-rank pp=4 run is
tests/distributed/test_pipeline_8procs.py.
"""

from __future__ import annotations

import time

import pytest
import torch

from lightning_moe_overlap.callbacks import ActivationOffload, SelectiveRecompute
from lightning_moe_overlap.overlap import CommRuntime, OverlapEngine, PeerFailure
from lightning_moe_overlap.parallel import ParallelDims
from lightning_moe_overlap.pipeline.executor import PipelineExecutor
from lightning_moe_overlap.pipeline.schedules import build_schedule, build_stages
from tests.helpers.distributed import mesh_groups, run_distributed
from tests.helpers.pipeline import (
    Sizes,
    assert_matches_reference,
    bitwise_problems,
    build_chunks,
    global_batches,
    loss_fn,
    register_block_names,
    train_pipeline,
)

WORLD = 4
SIZES = Sizes(pp=2, ep=2, dp=2, layers=4, microbatches=4)
PG_TIMEOUT_S = SIZES.timeout_s
OVERLAPPED = ("interleaved_1f1b", "dualpipev")  # vpp=2
MEMORY = {
    "selective": lambda: SelectiveRecompute(modules=["routed_experts", "moe_act"]),
    "full": lambda: SelectiveRecompute(granularity="full"),
    "offload": lambda: ActivationOffload(
        modules=["expert_fc1", "moe_act"], tensors=["dispatched_input"], min_tensor_size=0
    ),
}


def worker(rank: int, world_size: int) -> dict:
    torch.use_deterministic_algorithms(True)
    register_block_names()
    groups = mesh_groups(ParallelDims.from_world_size(world_size, pp=SIZES.pp, ep=SIZES.ep), rank)
    runs, problems, memory = {}, [], {}
    for name in OVERLAPPED:
        off = train_pipeline(groups, SIZES, name, 2, overlap=False)
        on = train_pipeline(groups, SIZES, name, 2, overlap=True)
        problems += bitwise_problems(f"rank {rank} {name}", on, off)
        runs[name] = on
        plain = {"params": off["first"], "losses": off["losses"][:1]}  # one step, no callback, overlap off
        for label, callback in MEMORY.items():
            mem_off = train_pipeline(groups, SIZES, name, 2, overlap=False, memory=callback, steps=1)
            mem_on = train_pipeline(groups, SIZES, name, 2, overlap=True, memory=callback, steps=1)
            memory[(name, label)] = {
                "problems": bitwise_problems(f"rank {rank} {name} {label} on vs off", mem_on, mem_off)
                + bitwise_problems(f"rank {rank} {name} {label} vs no callback", mem_on, plain),
                "act_calls": (mem_off["act_calls"], mem_on["act_calls"]),
                "offload": (mem_off["offload"], mem_on["offload"]),
                "pairs": mem_on["pairs"],
            }
    runs["1f1b"] = train_pipeline(groups, SIZES, "1f1b", 1, overlap=False)
    return {"runs": runs, "problems": problems, "memory": memory, "failure": failing_step(rank, groups)}


def failing_step(rank: int, groups) -> dict:
    """Rank 3 raises inside its last stage's forward of micro-batch 1 (the pair ``3F1|3B0``) in the second step."""
    fail = {"armed": False}
    coords = groups.coords
    runtime = CommRuntime()
    chunks, indices, _ = build_chunks(groups, SIZES, "interleaved_1f1b", 2, runtime, fail=fail if rank == 3 else None)
    num_stages = 2 * SIZES.pp
    schedule = build_schedule(
        "interleaved_1f1b", build_stages(chunks, indices, num_stages, groups.pp, torch.device("cpu")),
        SIZES.microbatches, loss_fn, overlap=True,
    )
    engine = OverlapEngine(runtime, overlap=True, timeout_s=PG_TIMEOUT_S, failure_poll_s=0.2)
    executor = PipelineExecutor(schedule, engine)
    x, y = global_batches(SIZES, 0)
    args = (x[coords.dp],) if 0 in indices else ()
    target = y[coords.dp] if num_stages - 1 in indices else None
    executor.step(*args, target=target, losses=[])  # a good step first: failure reports are keyed by step
    fail["armed"] = True
    start = time.monotonic()
    try:
        executor.step(*args, target=target, losses=[])
    except Exception as err:  # noqa: BLE001 - inspected by the test
        result = {"type": type(err).__name__, "message": str(err), "elapsed": time.monotonic() - start}
    else:
        result = {"type": None, "elapsed": time.monotonic() - start}
    if rank == 0:
        time.sleep(3.0)  # rank 0 hosts the c10d store: keep it up while the others read the failure report
    return result


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(worker, WORLD, timeout_s=PG_TIMEOUT_S)


def test_pipeline_schedules_overlapped_pairs_bitwise_and_match_the_unsplit_model(results: list[dict]) -> None:
    assert [r["problems"] for r in results] == [[]] * WORLD
    for name in (*OVERLAPPED, "1f1b"):
        assert_matches_reference(SIZES, results, name)
    for name in OVERLAPPED:
        assert all(results[r]["runs"][name]["pairs"] > 0 for r in range(WORLD)), name  # pairs ran on every rank


@pytest.mark.parametrize("label", list(MEMORY))
@pytest.mark.parametrize("name", OVERLAPPED)
def test_memory_callbacks_inside_overlapped_pairs(results: list[dict], name: str, label: str) -> None:
    """Overlap on == overlap off == no callback (``torch.equal``, compared in the worker), and the callback acted."""
    assert [r["memory"][(name, label)]["problems"] for r in results] == [[]] * WORLD
    for rank, result in enumerate(results):
        run = result["memory"][(name, label)]
        assert run["pairs"] > 0, (rank, run)
        off_calls, on_calls = run["act_calls"]
        forwards = SIZES.microbatches * SIZES.layers // SIZES.pp  # a rank's blocks, each micro-batch
        if label == "offload":  # nothing recomputed (a few more calls: torch's shape inference on the first step)
            assert forwards <= off_calls == on_calls < 2 * forwards, (rank, run)
            stats_off, stats_on = run["offload"]
            assert stats_on == stats_off and stats_on.offloaded_tensors > 0 and stats_on.reloaded_bytes > 0, run
        else:  # every activation ran again in a recomputation at least once
            assert off_calls >= 2 * forwards and on_calls >= 2 * forwards, (rank, run)


def test_failure_inside_a_stage_ends_every_rank_with_its_message(results: list[dict]) -> None:
    failures = [r["failure"] for r in results]
    assert failures[3]["type"] == "ValueError" and "boom inside stage 3" in failures[3]["message"], failures[3]
    for rank, failure in enumerate(failures):
        assert failure["elapsed"] < PG_TIMEOUT_S, (rank, failure)
        if rank != 3:
            assert failure["type"] == PeerFailure.__name__, (rank, failure)
            assert "rank 3: ValueError: boom inside stage 3" in failure["message"], (rank, failure)

