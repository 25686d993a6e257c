"""A stack of MoE blocks trained under a torch pipeline schedule with expert parallelism, at library level.

Shared by the multi-process pipeline tests: the unsplit model (:class:`Stack`), its pipeline chunks
(:class:`Chunk`), one rank's training run (:func:`train_pipeline`) and the single-process reference on the same
global batches (:func:`reference`). Sizes travel in a :class:`Sizes`.

Shapes: T tokens per micro-batch, D hidden, M micro-batches, E experts.
"""

from __future__ import annotations

import copy
import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lightning_moe_overlap.callbacks import ExpertStage, register_layer_names
from lightning_moe_overlap.moe.ep import apply_expert_parallel
from lightning_moe_overlap.moe.layer import MoELayer
from lightning_moe_overlap.overlap import CommRuntime, OverlapEngine
from lightning_moe_overlap.overlap.observers import CommObserver
from lightning_moe_overlap.parallel.grads import sync_gradients
from lightning_moe_overlap.pipeline.executor import PipelineExecutor
from lightning_moe_overlap.pipeline.schedules import build_schedule, build_stages, count_pairs, stage_indices


@dataclass(frozen=True)
class Sizes:
    """The parallel sizes (dp inferred by the caller's ``ParallelDims``), the model and the run."""

    pp: int
    ep: int
    dp: int
    layers: int
    microbatches: int  # M
    hidden: int = 8  # D
    tokens: int = 6  # T
    experts: int = 4  # E
    steps: int = 2
    lr: float = 0.1
    timeout_s: float = 120.0  # generous: the spawn and the first steps are slow on a loaded 2-core machine


class Block(nn.Module):
    def __init__(self, sizes: Sizes) -> None:
        super().__init__()
        d = sizes.hidden
        self.proj = nn.Linear(d, d)
        self.moe = MoELayer(hidden_size=d, ffn_hidden_size=12, num_experts=sizes.experts, top_k=2)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return x_TD + self.moe(torch.tanh(self.proj(x_TD)))


# What the memory callbacks' names mean in a Block (register in each process: the map is process-wide).
BLOCK_NAMES = {
    "routed_experts": "moe.experts",
    "moe_act": ExpertStage("moe.experts", "act"),
    "expert_fc1": ExpertStage("moe.experts", "fc1"),
    "dispatched_input": ExpertStage("moe.experts", "input"),
}


def register_block_names() -> None:
    register_layer_names(Block, BLOCK_NAMES, name="test Block")


class Stack(nn.Module):
    """The unsplit model: embed, ``sizes.layers`` blocks, head."""

    def __init__(self, sizes: Sizes) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(sizes.hidden, sizes.hidden)
        self.blocks = nn.ModuleList(Block(sizes) for _ in range(sizes.layers))
        self.head = nn.Linear(sizes.hidden, 1)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        h = self.embed(x_TD)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class Chunk(nn.Module):
    """Stage ``index`` of ``num_stages``: its blocks, the embedding on the first, the head on the last."""

    def __init__(self, stack: Stack, index: int, num_stages: int, fail: dict | None = None) -> None:
        super().__init__()
        per = len(stack.blocks) // num_stages
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


def global_batches(sizes: Sizes, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s data of every dp rank: ``x [DP, M*T, D]``, ``y [DP, M*T, 1]``."""
    g = torch.Generator().manual_seed(1000 + step)
    rows = sizes.microbatches * sizes.tokens
    return torch.randn(sizes.dp, rows, sizes.hidden, generator=g), torch.randn(sizes.dp, rows, 1, generator=g)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def build_chunks(groups, sizes: Sizes, schedule_name: str, vpp: int, runtime: CommRuntime, fail: dict | None = None):
    """This rank's chunks (expert-parallel), their stage indices and the ids of their expert parameters."""
    num_stages = sizes.pp * vpp
    indices = stage_indices(schedule_name, pp=sizes.pp, vpp=vpp, pp_rank=groups.coords.pp)
    stack = Stack(sizes)
    chunks = [Chunk(stack, i, num_stages, fail if i == num_stages - 1 else None) for i in indices]
    expert_ids: set[int] = set()
    for chunk in chunks:
        expert_ids |= {id(p) for m in apply_expert_parallel(chunk, groups.ep, runtime=runtime) for p in m.parameters()}
    return chunks, indices, expert_ids


def train_pipeline(
    groups,
    sizes: Sizes,
    schedule_name: str,
    vpp: int,
    overlap: bool,
    *,
    memory: Callable[[], object] | None = None,
    steps: int | None = None,
    slow_s: float = 0.0,
) -> dict:
    """``steps`` (default ``sizes.steps``) optimizer steps of this rank's chunks.

    Args:
        memory: builds a memory callback, applied to this rank's chunks (``callback.apply(chunks)``) after expert
            parallelism, as the strategy does.
        slow_s: each forward of this rank's chunks sleeps that long first (a slow stage).

    Returns:
        ``losses``: per step, the per-micro-batch losses (on the last stage's ranks, else empty); ``params``:
        {unsplit name (``@ep<r>`` for expert shards): tensor} after the last step, ``first`` after the first;
        ``pairs``: overlapped pairs per step; ``act_calls``: runs of the experts' activation stage (forwards and
        recomputations); ``offload``: what an offload moved.
    """
    coords = groups.coords
    runtime = CommRuntime()
    num_stages = sizes.pp * vpp
    chunks, indices, expert_ids = build_chunks(groups, sizes, schedule_name, vpp, runtime)
    callback = memory() if memory is not None else None
    engine_of_offload = callback.apply(chunks) if callback is not None else None
    act_calls = [0]

    def count(module: nn.Module, args: tuple) -> None:
        act_calls[0] += 1

    for chunk in chunks:
        for block in chunk.blocks:
            block.moe.experts.stage("act").register_forward_pre_hook(count)
        if slow_s:
            chunk.register_forward_pre_hook(lambda module, args: time.sleep(slow_s))
    handovers = HandOvers()
    runtime.attach(handovers)
    params = [p for c in chunks for p in c.parameters()]
    dense = [p for p in params if id(p) not in expert_ids]
    local = [p for p in params if id(p) in expert_ids]
    stages = build_stages(chunks, indices, num_stages, groups.pp, torch.device("cpu"))
    schedule = build_schedule(schedule_name, stages, sizes.microbatches, loss_fn, overlap=overlap)
    engine = OverlapEngine(runtime, overlap=overlap, timeout_s=sizes.timeout_s, failure_poll_s=0.2)
    executor = PipelineExecutor(schedule, engine)
    opt = torch.optim.SGD(params, lr=sizes.lr)
    holds_first, holds_last = 0 in indices, num_stages - 1 in indices
    step_losses, history = [], []
    for step in range(sizes.steps if steps is None else steps):
        handovers.clear()
        x, y = global_batches(sizes, step)
        losses: list[torch.Tensor] = []
        opt.zero_grad()
        executor.step(
            *((x[coords.dp],) if holds_first else ()), target=y[coords.dp] if holds_last else None, losses=losses
        )
        sync_gradients(dense, local, dp_cp_group=groups.dp_cp, edp_group=groups.edp, dp_cp_size=sizes.dp)
        opt.step()
        step_losses.append([float(loss.detach()) for loss in losses])
        history.append(
            {
                f"{names[n]}@ep{coords.ep}" if id(p) in expert_ids else names[n]: p.detach().clone()
                for chunk in chunks
                for names in [chunk.unsplit_names()]
                for n, p in chunk.named_parameters()
            }
        )
    if callback is not None:
        callback.remove()
    pairs = count_pairs(schedule.pipeline_order)[coords.pp] if overlap else 0
    stats = engine_of_offload.stats if engine_of_offload is not None else None
    return {
        "losses": step_losses, "params": history[-1], "first": history[0], "pairs": pairs, "act_calls": act_calls[0],
        "offload": stats, "handovers": handovers.events,
    }


class HandOvers(CommObserver):
    """The last step's engine events in order: ``("start", task name)``, ``("end", task name)`` and ``("handoff",
    "F" | "B")`` (the role handing the baton over, at a comm point)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.events: list[tuple[str, str]] = []

    def clear(self) -> None:
        with self._lock:
            self.events = []

    def on_task_start(self, task) -> None:
        with self._lock:
            self.events.append(("start", task.name))

    def on_task_end(self, task) -> None:
        with self._lock:
            self.events.append(("end", task.name))

    def on_handoff(self, holder) -> None:
        if holder is not None:
            with self._lock:
                self.events.append(("handoff", holder.letter))


def bitwise_problems(label: str, on: dict, off: dict) -> list[str]:
    """What differs between two runs' parameters and losses (``torch.equal``, exact floats)."""
    problems = [
        f"{label}: {key} differs by {(on['params'][key] - ref).abs().max()}"
        for key, ref in off["params"].items()
        if not torch.equal(on["params"][key], ref)
    ]
    if on["losses"] != off["losses"]:
        problems.append(f"{label}: losses {on['losses']} != {off['losses']}")
    return problems


@functools.lru_cache(maxsize=4)
def reference(sizes: Sizes) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The unsplit stack in one process: per step, the mean over dp ranks and micro-batches of the loss (cached:
    do not modify the tensors)."""
    torch.use_deterministic_algorithms(True)
    stack = Stack(sizes)
    opt = torch.optim.SGD(stack.parameters(), lr=sizes.lr)
    losses = []
    dp, m_count, t = sizes.dp, sizes.microbatches, sizes.tokens
    for step in range(sizes.steps):
        x, y = global_batches(sizes, step)
        opt.zero_grad()
        total = 0.0
        for d in range(dp):
            for m in range(m_count):
                rows = slice(m * t, (m + 1) * t)
                loss = loss_fn(stack(x[d, rows]), y[d, rows])
                (loss / (dp * m_count)).backward()
                total += float(loss.detach()) / (dp * m_count)
        opt.step()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in stack.named_parameters()}


def assert_matches_reference(sizes: Sizes, results: list[dict], name: str) -> None:
    """Run ``name`` of every rank (``results[rank]["runs"][name]``) against :func:`reference`: parameters allclose
    (expert shards concatenated over ep), per-step losses within 1e-5 (mean over the last stage's dp ranks)."""
    ref_losses, ref_params = reference(sizes)
    params: dict[str, torch.Tensor] = {}
    for result in results:
        params.update(result["runs"][name]["params"])
    for key, ref in ref_params.items():
        if key in params:
            got = params[key]
        else:  # experts: the ep ranks' shards in order
            got = torch.cat([params[f"{key}@ep{e}"] for e in range(sizes.ep)])
            assert got.shape[0] == sizes.experts, (name, key, got.shape)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} {key}: {m}")
    last_stage_ranks = [r for r, result in enumerate(results) if result["runs"][name]["losses"][0]]
    assert len(last_stage_ranks) == sizes.dp, (name, last_stage_ranks)
    for step in range(sizes.steps):
        got = sum(sum(results[r]["runs"][name]["losses"][step]) / sizes.microbatches for r in last_stage_ranks)
        got /= sizes.dp
        assert abs(got - ref_losses[step]) < 1e-5, (name, step, got, ref_losses[step])
