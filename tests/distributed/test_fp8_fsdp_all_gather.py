"""``MoEOverlapStrategy(fp8="tensorwise", shard="full")`` on 2 gloo ranks (ep=2, dp=2): the dense FP8 linears'
weights are all-gathered in float8 by ``fully_shard`` (torchao's ``enable_fsdp_float8_all_gather``, scales
precomputed after each optimizer step), and training is that of the same run with the weights all-gathered in
float32.

Oracle: the same configuration with the float8 all-gather turned off (the strategy's choice patched at test time).
With tensorwise scaling the weight's scale is the amax of the whole weight either way (all-reduced over the shards,
or taken after the gather), and casting a shard to float8 then gathering equals gathering then casting: measured
bitwise equal over 3 steps (losses and every parameter).

A second ``fit`` of the same model with a new Trainer (a new strategy, which takes the prepared model's record)
precomputes the scales after each of its steps too.
"""

from __future__ import annotations

import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap import strategy as strategy_module
from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.fp8 import dense
from lightning_moe_overlap.parallelize import steps as parallel_apply
from lightning_moe_overlap.parallel.dtensors import local
from tests.helpers.data import RandomTokens
from tests.helpers.distributed import run_distributed

WORLD, STEPS, BATCH, MICRO, SEQ = 2, 3, 4, 2, 9


class Tokens(RandomTokens):
    def __init__(self, n: int = WORLD * STEPS * BATCH) -> None:
        super().__init__(n, SEQ, 64, seed=5)


def _fit(float8_all_gather: bool, model: MoEGPT | None = None) -> dict:
    torch.manual_seed(0)
    model = model or MoEGPT(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_experts=4, top_k=2,
                            ffn_hidden_size=16, lr=1e-2, seed=3)  # fmt: skip
    losses: list[float] = []
    model.on_train_batch_end = lambda outputs, *_: losses.append(float(outputs["loss"]))
    precomputed: list[int] = []
    precompute = dense.precompute_float8_scales

    def counted(module: torch.nn.Module) -> None:
        precomputed.append(1)
        precompute(module)

    strategy = MoEOverlapStrategy(ep=2, num_microbatches=MICRO, shard="full", fp8="tensorwise")
    trainer = Trainer(
        accelerator="cpu", devices=WORLD, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        strategy=strategy,
    )  # fmt: skip
    recipe = parallel_apply.FLOAT8_ALL_GATHER_RECIPE
    parallel_apply.FLOAT8_ALL_GATHER_RECIPE = recipe if float8_all_gather else None
    strategy_module.precompute_float8_scales = counted
    try:
        trainer.fit(model, train_dataloaders=DataLoader(Tokens(), batch_size=BATCH))
    finally:
        parallel_apply.FLOAT8_ALL_GATHER_RECIPE = recipe
        strategy_module.precompute_float8_scales = precompute
    proj = model.layers[0].attn.proj
    wrapped = local(proj.weight)  # the shard (FSDP's DTensor)
    return {
        "losses": losses,
        "state": {n: local(p).detach().clone() for n, p in model.named_parameters()},
        "report": strategy.fp8_report.float8_all_gather,
        "weight_type": type(wrapped).__name__,
        "precomputed": len(precomputed),
        "model": model,
    }


def _worker(rank: int, world: int) -> dict:
    on, off = _fit(True), _fit(False)
    again = _fit(True, model=on.pop("model"))  # a new Trainer and strategy, the prepared model
    del off["model"], again["model"]
    return {"float8": on, "float32": off, "again": {k: again[k] for k in ("report", "precomputed", "losses")}}


def test_shard_full_fp8_all_gathers_in_float8_and_trains_as_without_it():
    results = run_distributed(_worker, WORLD, timeout_s=300)
    for rank, result in enumerate(results):
        on, off = result["float8"], result["float32"]
        assert (on["report"], on["weight_type"], on["precomputed"]) == (
            True, "WeightWithDynamicFloat8CastTensor", STEPS
        ), f"rank {rank}"  # fmt: skip
        assert (off["report"], off["precomputed"]) == (False, 0) and off["weight_type"] != on["weight_type"]
        assert len(on["losses"]) == STEPS and on["losses"] == off["losses"], f"rank {rank}"
        again = result["again"]
        assert (again["report"], again["precomputed"], len(again["losses"])) == (True, STEPS, STEPS), f"rank {rank}"
        for name, value in off["state"].items():
            assert torch.equal(on["state"][name], value), f"rank {rank}: {name}"
