"""Pipeline schedules with the overlapped pair on 4 gloo ranks: pp=2 x ep=2 (dp=2), chunks of MoE blocks.

One spawn runs every check on the same process groups:
- interleaved 1F1B (vpp=2), DualPipeV and 1F1B (vpp=1, the paired order of ``pipeline/paired_1f1b.py``):
  parameters after the steps with overlap on are ``torch.equal`` to the same schedule run by torch alone (overlap
  off); 1F1B's pairs per stage are those its rule gives, at M = 4 and at M = 2, 3, 5 with one stage slow (no
  deadlock), and the engine's record shows each pair's forward and backward handing over to each other in turn;
- the same two schedules with each memory callback attached to every rank's chunks (``callback.apply(chunks)``):
  selective recompute (the routed experts, whose recomputation re-runs their all-to-alls inside the backward
  context, and the experts' activation nested in it), full-layer recompute, activation offload. One step each;
  with overlap on and off, parameters and losses are ``torch.equal`` to each other and to the run without the
  callback, and the callback did act (recomputations ran, tensors moved to the host and back);
- those runs match a single-process run of the unsplit stack on the same global batches:
  per-step losses within 1e-5, parameters allclose;
- last, rank 3 raises inside a stage's forward during an overlapped pair: every rank ends, before the process-group
  timeout, rank 3 with its own error and the others with a ``PeerFailure`` naming it.

The model, the training run and the reference are in tests/helpers/pipeline.py; the 8-rank pp=4 run is
tests/distributed/test_pipeline_8procs.py.
"""

from __future__ import annotations

import dataclasses
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
VPP = {"interleaved_1f1b": 2, "dualpipev": 2, "1f1b": 1}  # the schedules run with overlap, their stages per rank
OVERLAPPED = tuple(VPP)
SLOW = ((2, 0), (3, 1), (5, 0))  # (M, the pp rank whose stage is slow): M = pp, pp + 1, 2 pp + 1 under 1F1B
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
        off = train_pipeline(groups, SIZES, name, VPP[name], overlap=False)
        on = train_pipeline(groups, SIZES, name, VPP[name], overlap=True)
        problems += bitwise_problems(f"rank {rank} {name}", on, off)
        runs[name] = on
        plain = {"params": off["first"], "losses": off["losses"][:1]}  # one step, no callback, overlap off
        for label, callback in MEMORY.items():
            mem_off = train_pipeline(groups, SIZES, name, VPP[name], overlap=False, memory=callback, steps=1)
            mem_on = train_pipeline(groups, SIZES, name, VPP[name], overlap=True, memory=callback, steps=1)
            memory[(name, label)] = {
                "problems": bitwise_problems(f"rank {rank} {name} {label} on vs off", mem_on, mem_off)
                + bitwise_problems(f"rank {rank} {name} {label} vs no callback", mem_on, plain),
                "act_calls": (mem_off["act_calls"], mem_on["act_calls"]),
                "offload": (mem_off["offload"], mem_on["offload"]),
                "pairs": mem_on["pairs"],
            }
    slow = {}
    for m, slow_rank in SLOW:  # 1F1B paired at other M, one stage slow: no deadlock, bitwise the plain order
        sizes = dataclasses.replace(SIZES, microbatches=m)
        delay = 0.05 if groups.coords.pp == slow_rank else 0.0
        off = train_pipeline(groups, sizes, "1f1b", 1, overlap=False, steps=1, slow_s=delay)
        on = train_pipeline(groups, sizes, "1f1b", 1, overlap=True, steps=1, slow_s=delay)
        problems += bitwise_problems(f"rank {rank} 1f1b M={m} slow pp rank {slow_rank}", on, off)
        slow[m] = on["pairs"]
    return {"runs": runs, "problems": problems, "memory": memory, "slow": slow, "pp_rank": groups.coords.pp,
            "failure": failing_step(rank, groups)}


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
    for name in OVERLAPPED:
        assert_matches_reference(SIZES, results, name)
        assert all(results[r]["runs"][name]["pairs"] > 0 for r in range(WORLD)), name  # pairs ran on every rank


def test_1f1b_pairs_as_its_rule_says_at_every_m_without_deadlock(results: list[dict]) -> None:
    """The pairs of each stage, counted by the run (warm-up ``min(2 (pp - 1 - s) + 1, M)``, the rest paired), at
    M = 4 and at the slow-stage runs of M = 2, 3, 5 (each ended, bitwise the plain 1F1B order)."""
    for result in results:
        s = result["pp_rank"]
        expected = {m: m - min(2 * (SIZES.pp - 1 - s) + 1, m) for m in (SIZES.microbatches, *dict(SLOW))}
        got = {SIZES.microbatches: result["runs"]["1f1b"]["pairs"], **result["slow"]}
        assert got == expected, (s, got, expected)


def test_each_1f1b_pair_alternates_its_forward_and_backward_at_the_all_to_alls(results: list[dict]) -> None:
    """The engine's record of the last step: every pair starts with the backward, the forward starts at the
    backward's first hand-over, and the two hand the baton to each other in turn, at least once per all-to-all
    of the forward (two per MoE layer) before either ends."""
    layers = SIZES.layers // SIZES.pp
    for rank, result in enumerate(results):
        events = result["runs"]["1f1b"]["handovers"]
        pairs = 0
        for k, (kind, name) in enumerate(events):
            if kind != "start" or "B" not in name:
                continue
            assert events[k + 1] == ("handoff", "B") and events[k + 2][0] == "start" and "F" in events[k + 2][1]
            rest = events[k + 3 :]
            until_end = rest[: next(i for i, e in enumerate(rest) if e[0] == "end")]
            letters = [who for _, who in until_end]
            assert letters[:: 2] == ["F"] * len(letters[:: 2]) and letters[1:: 2] == ["B"] * len(letters[1:: 2])
            assert len(letters) >= 2 * layers, (rank, letters)
            pairs += 1
        assert pairs == result["runs"]["1f1b"]["pairs"] > 0, (rank, events)


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

