"""``MoEOverlapStrategy(alltoall_static=True)`` under Lightning's Trainer on 2 gloo ranks (ep=2, overlap on): a tiny
Hugging Face Qwen3-MoE trains as with the plain dispatch, alone and with ``delay_wgrad``.

Oracle: the same fit with ``alltoall_static=False``. On CPU the plain dispatch runs each expert's rows in
per-source segments and the static one in one grouped GEMM, so the losses agree within the reordering of float32
sums (not bitwise; ``tests/distributed/test_static_dispatch.py`` holds the bitwise comparison against the plain
dispatch's CUDA layout). Counted per rank: every MoE layer dispatched statically once per micro-batch and step.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo_hf import HFMoECausalLM
from lightning_moe_overlap.moe.ep import ExpertParallelExperts
from tests.helpers.data import RandomTokens
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.long

WORLD, MICRO, STEPS, BATCH, SEQ, LAYERS = 2, 2, 3, 4, 9, 2


def _fit(static: bool, delay: bool) -> dict:
    model = HFMoECausalLM("qwen3_moe", config_overrides={"num_hidden_layers": LAYERS})
    losses: list[torch.Tensor] = []
    model.on_train_batch_end = lambda outputs, *_: losses.append(outputs["loss"].detach().clone())
    trainer = Trainer(
        accelerator="cpu", devices=WORLD, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        strategy=MoEOverlapStrategy(ep=2, num_microbatches=MICRO, delay_wgrad=delay, alltoall_static=static),
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=DataLoader(RandomTokens(32, SEQ, 128, seed=3), batch_size=BATCH))
    experts = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
    usage = [m.dispatcher.static_usage() for m in experts] if static else []
    return {"losses": torch.stack(losses), "usage": usage, "layers": len(experts)}


def _worker(rank: int, world: int) -> dict:
    return {(static, delay): _fit(static, delay) for static, delay in ((False, False), (True, False), (True, True))}


def test_static_dispatch_trains_as_the_plain_one() -> None:
    for rank, result in enumerate(run_distributed(_worker, WORLD, timeout_s=240)):
        plain = result[(False, False)]
        assert plain["layers"] == LAYERS, rank
        for key in ((True, False), (True, True)):
            run = result[key]
            # float32 losses of a few hundred reordered products per entry: 1e-5 relative is 2**-23 times ~80 terms
            torch.testing.assert_close(run["losses"], plain["losses"], rtol=1e-5, atol=1e-6)
            assert [u.calls for u in run["usage"]] == [STEPS * MICRO] * LAYERS, (rank, key, run["usage"])
            assert all(u.dropped == 0 and 0 < u.rows <= u.slots for u in run["usage"]), (rank, key)
        assert not torch.equal(plain["losses"][0], plain["losses"][-1])  # it trains
