"""Pipeline schedules with the overlapped pair on 4 gloo ranks: pp=2 x ep=2 (dp=2), chunks of MoE blocks.

One spawn runs every check on the same process groups:
- interleaved 1F1B (vpp=2) and DualPipeV: parameters after the steps with overlap on are ``torch.equal`` to the
  same schedule run by torch alone (overlap off);
- those runs and plain 1F1B (vpp=1) match a single-process run of the unsplit stack on the same global batches:
  per-step losses within 1e-5, parameters allclose;
- last, rank 3 raises inside a stage's forward during an overlapped pair: every rank ends, before the process-group
  timeout, rank 3 with its own error and the others with a ``PeerFailure`` naming it.

Shapes: T tokens per micro-batch, D hidden, M micro-batches, E experts.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

from lightning_moe_overlap.grads import sync_gradients
from lightning_moe_overlap.moe.adapters import apply_expert_parallel
from lightning_moe_overlap.moe.layer import MoELayer
from lightning_moe_overlap.overlap import CommRuntime, OverlapEngine, PeerFailure
from lightning_moe_overlap.parallel import ParallelDims, build_groups
from lightning_moe_overlap.pipeline.executor import PipelineExecutor
from lightning_moe_overlap.pipeline.schedules import build_schedule, build_stages, count_pairs, stage_indices
from tests.helpers.distributed import run_distributed

WORLD, PP, EP, DP = 4, 2, 2, 2
D, T, M, E, LAYERS, STEPS, LR = 8, 6, 4, 4, 4, 2, 0.1
PG_TIMEOUT_S = 120.0  # generous: the spawn and the first steps are slow on a loaded 2-core machine


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.moe = MoELayer(hidden_size=D, ffn_hidden_size=12, num_experts=E, top_k=2)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return x_TD + self.moe(torch.tanh(self.proj(x_TD)))


class Stack(nn.Module):
    """The unsplit model: embed, LAYERS blocks, head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(D, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(D, 1)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        h = self.embed(x_TD)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class Chunk(nn.Module):
    """Stage ``index`` of ``num_stages``: its blocks, the embedding on the first, the head on the last."""

    def __init__(self, stack: Stack, index: int, num_stages: int, fail: dict | None = None) -> None:
        super().__init__()
        per = LAYERS // num_stages
        self.first, self.index = per * index, index
        self.embed = copy.deepcopy(stack.embed) if index == 0 else None
        self.blocks = nn.ModuleList(copy.deepcopy(stack.blocks[self.first + k]) for k in range(per))
        self.head = copy.deepcopy(stack.head) if index == num_stages - 1 else None
        self.fail = fail

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        h = self.embed(x_TD) if self.embed is not None else x_TD
        for k, block in enumerate(self.blocks):
            h = block(h)
            if self.fail is not None and self.fail.get("armed") and k == 0:
                self.fail["calls"] = self.fail.get("calls", 0) + 1
                if self.fail["calls"] == 2:  # the second forward of the step: micro-batch 1, inside a pair
                    raise ValueError(f"boom inside stage {self.index}")
        return self.head(h) if self.head is not None else h

    def unsplit_names(self) -> dict[str, str]:
        """Parameter name here -> in :class:`Stack`."""
        out = {}
        for name, _ in self.named_parameters():
            part, _, rest = name.partition(".")
            if part == "blocks":
                k, _, rest = rest.partition(".")
                out[name] = f"blocks.{self.first + int(k)}.{rest}"
            else:
                out[name] = name
        return out


def global_batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s data of every dp rank: ``x [DP, M*T, D]``, ``y [DP, M*T, 1]``."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(DP, M * T, D, generator=g), torch.randn(DP, M * T, 1, generator=g)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def train_pipeline(rank: int, groups, schedule_name: str, vpp: int, overlap: bool, fail: dict | None = None):
    """STEPS steps; returns (per-step losses on the last stage's ranks, {unsplit name: parameter or its shard})."""
    coords = groups.coords
    runtime = CommRuntime()
    num_stages = PP * vpp
    indices = stage_indices(schedule_name, pp=PP, vpp=vpp, pp_rank=coords.pp)
    stack = Stack()
    chunks = [Chunk(stack, i, num_stages, fail if i == num_stages - 1 else None) for i in indices]
    expert_ids: set[int] = set()
    for chunk in chunks:
        expert_ids |= {id(p) for m in apply_expert_parallel(chunk, groups.ep, runtime=runtime) for p in m.parameters()}
    params = [p for c in chunks for p in c.parameters()]
    dense = [p for p in params if id(p) not in expert_ids]
    local = [p for p in params if id(p) in expert_ids]
    stages = build_stages(chunks, indices, num_stages, groups.pp, torch.device("cpu"))
    schedule = build_schedule(schedule_name, stages, M, loss_fn, overlap=overlap)
    engine = OverlapEngine(runtime, overlap=overlap, timeout_s=PG_TIMEOUT_S, failure_poll_s=0.2)
    executor = PipelineExecutor(schedule, engine)
    opt = torch.optim.SGD(params, lr=LR)
    holds_first, holds_last = 0 in indices, num_stages - 1 in indices
    step_losses = []
    for step in range(STEPS):
        x, y = global_batches(step)
        losses: list[torch.Tensor] = []
        opt.zero_grad()
        executor.step(
            *((x[coords.dp],) if holds_first else ()), target=y[coords.dp] if holds_last else None, losses=losses
        )
        sync_gradients(dense, local, dp_cp_group=groups.dp_cp, edp_group=groups.edp, dp_cp_size=DP)
        opt.step()
        step_losses.append([float(loss.detach()) for loss in losses])
    state = {
        f"{names[n]}@ep{coords.ep}" if id(p) in expert_ids else names[n]: p.detach().clone()
        for chunk in chunks
        for names in [chunk.unsplit_names()]
        for n, p in chunk.named_parameters()
    }
    pairs = count_pairs(schedule.pipeline_order)[coords.pp] if overlap else 0
    return {"losses": step_losses, "params": state, "pairs": pairs}


def worker(rank: int, world_size: int) -> dict:
    torch.use_deterministic_algorithms(True)
    groups = build_groups(ParallelDims.from_world_size(world_size, pp=PP, ep=EP), rank)
    runs, problems = {}, []
    for name, vpp in (("interleaved_1f1b", 2), ("dualpipev", 2)):
        off = train_pipeline(rank, groups, name, vpp, overlap=False)
        on = train_pipeline(rank, groups, name, vpp, overlap=True)
        for key, ref in off["params"].items():
            if not torch.equal(on["params"][key], ref):
                problems.append(f"rank {rank} {name}: {key} differs by {(on['params'][key] - ref).abs().max()}")
        if on["losses"] != off["losses"]:
            problems.append(f"rank {rank} {name}: losses {on['losses']} != {off['losses']}")
        runs[name] = on
    runs["1f1b"] = train_pipeline(rank, groups, "1f1b", 1, overlap=False)
    return {"runs": runs, "problems": problems, "failure": failing_step(rank, groups)}


def failing_step(rank: int, groups) -> dict:
    """Rank 3 raises inside its last stage's forward of micro-batch 1 (the pair ``3F1|3B0``) in the second step."""
    fail = {"armed": False}
    coords = groups.coords
    indices = stage_indices("interleaved_1f1b", pp=PP, vpp=2, pp_rank=coords.pp)
    runtime = CommRuntime()
    stack = Stack()
    chunks = [Chunk(stack, i, 2 * PP, fail if rank == 3 and i == 2 * PP - 1 else None) for i in indices]
    for chunk in chunks:
        apply_expert_parallel(chunk, groups.ep, runtime=runtime)
    schedule = build_schedule(
        "interleaved_1f1b", build_stages(chunks, indices, 2 * PP, groups.pp, torch.device("cpu")), M, loss_fn,
        overlap=True,
    )
    executor = PipelineExecutor(schedule, OverlapEngine(runtime, overlap=True, timeout_s=PG_TIMEOUT_S, failure_poll_s=0.2))
    x, y = global_batches(0)
    args = (x[coords.dp],) if 0 in indices else ()
    target = y[coords.dp] if 2 * PP - 1 in indices else None
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


def reference(runs_steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The unsplit stack in one process: per step, the mean over dp ranks and micro-batches of the loss."""
    torch.use_deterministic_algorithms(True)
    stack = Stack()
    opt = torch.optim.SGD(stack.parameters(), lr=LR)
    losses = []
    for step in range(runs_steps):
        x, y = global_batches(step)
        opt.zero_grad()
        total = 0.0
        for d in range(DP):
            for m in range(M):
                rows = slice(m * T, (m + 1) * T)
                loss = loss_fn(stack(x[d, rows]), y[d, rows])
                (loss / (DP * M)).backward()
                total += float(loss) / (DP * M)
        opt.step()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in stack.named_parameters()}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(worker, WORLD, timeout_s=PG_TIMEOUT_S)


def test_pipeline_schedules_overlapped_pairs_bitwise_and_match_the_unsplit_model(results: list[dict]) -> None:
    assert [r["problems"] for r in results] == [[]] * WORLD
    ref_losses, ref_params = reference(STEPS)
    per_expert = E // EP
    for name in ("interleaved_1f1b", "dualpipev", "1f1b"):
        params: dict[str, torch.Tensor] = {}
        for rank in range(WORLD):
            params.update(results[rank]["runs"][name]["params"])
        for key, ref in ref_params.items():
            if key in params:
                got = params[key]
            else:  # experts: the ep ranks' shards in order
                got = torch.cat([params[f"{key}@ep{e}"] for e in range(EP)])
                assert got.shape[0] == per_expert * EP
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} {key}: {m}")
        last_stage_ranks = [r for r in range(WORLD) if results[r]["runs"][name]["losses"][0]]
        assert len(last_stage_ranks) == DP, (name, last_stage_ranks)
        for step in range(STEPS):
            got = sum(sum(results[r]["runs"][name]["losses"][step]) / M for r in last_stage_ranks) / DP
            assert abs(got - ref_losses[step]) < 1e-5, (name, step, got, ref_losses[step])
    for name in ("interleaved_1f1b", "dualpipev"):
        assert all(results[r]["runs"][name]["pairs"] > 0 for r in range(WORLD)), name  # pairs ran on every rank


def test_failure_inside_a_stage_ends_every_rank_with_its_message(results: list[dict]) -> None:
    failures = [r["failure"] for r in results]
    assert failures[3]["type"] == "ValueError" and "boom inside stage 3" in failures[3]["message"], failures[3]
    for rank, failure in enumerate(failures):
        assert failure["elapsed"] < PG_TIMEOUT_S, (rank, failure)
        if rank != 3:
            assert failure["type"] == PeerFailure.__name__, (rank, failure)
            assert "rank 3: ValueError: boom inside stage 3" in failure["message"], (rank, failure)

