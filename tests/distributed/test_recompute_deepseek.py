"""Full recompute of HF DeepSeek-V3 (2 layers, 4 experts, top-2, a shared expert, MLA) at ep=2 on 2 gloo ranks,
overlap on: the losses, the parameters and the ``e_score_correction_bias`` after each step equal those of the run
without recompute (the one-process twin for every family is tests/unit/test_recompute_hf_families.py)."""

from __future__ import annotations

import pytest
import torch

from lightning_moe_overlap.callbacks import SelectiveRecompute
from lightning_moe_overlap.parallel.grads import sync_gradients
from lightning_moe_overlap.moe.bias import correction_bias_balancers
from lightning_moe_overlap.moe.ep import ExpertParallelExperts
from lightning_moe_overlap.overlap.engine import OverlapEngine
from lightning_moe_overlap.overlap.runtime import CommRuntime
from lightning_moe_overlap.parallel import ParallelDims
from tests.helpers.distributed import mesh_groups, run_distributed

pytest.importorskip("transformers")

WORLD, STEPS, MICRO = 2, 2, 2


def _train(rank: int, groups, recompute: bool, overlap: bool) -> dict[str, list]:
    from tests.unit.test_recompute_hf_families import VOCAB, build

    runtime = CommRuntime()
    model = build("deepseek_v3", groups.ep, runtime)
    balancers = correction_bias_balancers(model)
    cb = SelectiveRecompute(granularity="full") if recompute else None
    if cb is not None:
        cb.apply(model)
    expert_ids = {id(p) for m in model.modules() if isinstance(m, ExpertParallelExperts) for p in m.parameters()}
    dense = [p for p in model.parameters() if id(p) not in expert_ids]
    local = [p for p in model.parameters() if id(p) in expert_ids]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = OverlapEngine(runtime, overlap=overlap, timeout_s=60)
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own tokens, alike in both runs
    seen: dict[str, list] = {"loss": [], "bias": [], "params": []}
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (MICRO, 2, 8), generator=g)
        opt.zero_grad()
        losses = engine.run(
            lambda i, t=tokens: model(input_ids=t[i], labels=t[i]).loss, lambda i, loss: (loss / MICRO).backward(),
            MICRO,
        )
        seen["loss"].append([float(x) for x in losses])
        sync_gradients(dense, local, dp_cp_group=groups.dp_cp, edp_group=groups.edp, dp_cp_size=WORLD)
        for b in balancers:
            b.update(group=groups.dp_cp)
        seen["bias"].append([b.router.e_score_correction_bias.clone() for b in balancers])
        opt.step()
    seen["params"] = [p.detach().clone() for p in model.parameters()]
    if cb is not None:
        assert cb._handles
        cb.remove()
    return seen


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    groups = mesh_groups(ParallelDims.from_world_size(world, ep=2), rank)
    reference = _train(rank, groups, recompute=False, overlap=False)
    got = _train(rank, groups, recompute=True, overlap=True)
    same = {
        "loss": got["loss"] == reference["loss"],
        "bias": all(torch.equal(a, b) for xs, ys in zip(got["bias"], reference["bias"]) for a, b in zip(xs, ys)),
        "params": all(torch.equal(a, b) for a, b in zip(got["params"], reference["params"])),
    }
    moved = all(bool(b.abs().sum() > 0) for b in reference["bias"][0])
    return {"same": same, "bias_moved": moved}


def test_full_recompute_of_deepseek_v3_at_ep2_with_overlap_matches_no_recompute():
    for rank, result in enumerate(run_distributed(_worker, WORLD, timeout_s=180)):
        assert result["bias_moved"], rank  # the bias comparison is not vacuous
        assert result["same"] == {"bias": True, "loss": True, "params": True}, (rank, result)
