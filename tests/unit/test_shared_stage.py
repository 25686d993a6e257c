"""The shared experts' stage (``moe/shared.py``): under ``shared_expert_overlap`` their computation is one call of
an explicit module, where forward hooks and ``torch.utils.checkpoint`` attach, once per micro-batch with the
overlap schedule on, and the results stay bitwise those of the inline block run sequentially."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from lightning_moe_overlap.moe import apply_expert_parallel
from lightning_moe_overlap.moe.dispatch.loopback import Loopback
from lightning_moe_overlap.moe.shared import shared_stage
from lightning_moe_overlap.moe.stages import ExpertsStage
from lightning_moe_overlap.overlap import run_schedule
from lightning_moe_overlap.overlap.runtime import CommRuntime
from tests.unit.test_shared_overlap import deepseek_block, own_block, qwen2_block

M = 3  # micro-batches

BLOCKS = pytest.mark.parametrize("make", [qwen2_block, deepseek_block, own_block], ids=["qwen2_moe", "deepseek_v3", "own"])


def _blocks(make, overlap_shared: bool) -> tuple[torch.nn.Module, torch.nn.Module, CommRuntime]:  # noqa: ANN001
    """The block with ``shared_expert_overlap`` and its inline twin (same weights), each expert-parallel over a
    loopback communicator, so every comm point issues, hands over and waits as with real ranks."""
    torch.manual_seed(0)
    block, _ = make()
    with torch.no_grad():
        for p in block.parameters():  # HF blocks built alone are not initialised
            p.normal_(0.0, 0.2)
    ref = copy.deepcopy(block)
    runtime = CommRuntime(communicator=Loopback(0.0))
    apply_expert_parallel(block, None, runtime=runtime, shared_expert_overlap=overlap_shared)
    apply_expert_parallel(ref, None, runtime=CommRuntime(communicator=Loopback(0.0)))
    return block, ref, runtime


def _train(block: torch.nn.Module, runtime: CommRuntime, overlap: bool) -> tuple[list[torch.Tensor], list]:
    x = torch.randn(M, 2, 5, 16, generator=torch.Generator().manual_seed(7))
    outs = run_schedule(
        lambda i: block(x[i]), lambda i, out: out.square().sum().backward(), M, runtime, overlap=overlap
    )
    return [o.detach() for o in outs], [p.grad.clone() for p in block.parameters()]


@BLOCKS
def test_a_hook_on_the_shared_stage_fires_once_per_microbatch_with_overlap_on(make) -> None:  # noqa: ANN001
    block, ref, runtime = _blocks(make, overlap_shared=True)
    stage = shared_stage(block)
    assert stage is not None and not any(True for _ in stage.parameters(recurse=False))
    calls: list[int] = []
    stage.register_forward_hook(lambda m, args, out: calls.append(out.shape[0]))
    got = _train(block, runtime, overlap=True)
    want = _train(ref, CommRuntime(communicator=Loopback(0.0)), overlap=False)
    assert len(calls) == M and all(rows > 0 for rows in calls)  # the real computation, never the zero-row probe
    for a, b in zip(got[0] + got[1], want[0] + want[1], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("make", [qwen2_block, deepseek_block], ids=["qwen2_moe", "deepseek_v3"])
def test_the_window_runs_the_shared_experts_through_a_stage_of_the_block(make) -> None:  # noqa: ANN001
    block, _, _ = _blocks(make, overlap_shared=True)
    stage = block.shared_stage
    assert isinstance(stage, ExpertsStage) and stage.name == "shared" and shared_stage(block) is stage
    assert "shared_stage" not in {k.split(".")[0] for k in block.state_dict()}  # no parameters: same keys
    plain, _, _ = _blocks(make, overlap_shared=False)
    assert not hasattr(plain, "shared_stage") and shared_stage(plain) is getattr(plain, make()[1])


@pytest.mark.parametrize("make", [qwen2_block, deepseek_block], ids=["qwen2_moe", "deepseek_v3"])
def test_a_checkpoint_on_the_shared_stage_recomputes_it_and_keeps_the_results(make) -> None:  # noqa: ANN001
    """Oracle for the recomputation: a pre-hook inside the shared experts fires again in backward (a pre-hook:
    the recomputation stops once it has what backward needs, which is inside the last projection's call)."""
    block, ref, runtime = _blocks(make, overlap_shared=True)
    block.shared_stage.add_wrapper(lambda fn: lambda *a: checkpoint(fn, *a, use_reentrant=False))
    inner = getattr(block, make()[1]).down_proj
    calls: list[bool] = []
    inner.register_forward_pre_hook(lambda m, args: calls.append(True) if args[0].numel() else None)
    got = _train(block, runtime, overlap=True)
    want = _train(ref, CommRuntime(communicator=Loopback(0.0)), overlap=False)
    assert len(calls) == 2 * M  # each micro-batch's forward, and its recomputation in backward
    for a, b in zip(got[0] + got[1], want[0] + want[1], strict=True):
        assert torch.equal(a, b)
