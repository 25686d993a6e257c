"""``MoEOverlapStrategy(compile=True)``: which modules are compiled, and a compiled run against the eager one.

Oracles: the modules named by hand for each family; the same fit without ``compile`` (eager), and Dynamo's own
counters (what it captured, where it broke the graph).
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader

from lightning_moe_overlap import ActivationOffload, MoEOverlapStrategy, SelectiveRecompute
from lightning_moe_overlap.config import OverlapConfig
from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.demo_hf import HFMoECausalLM
from lightning_moe_overlap.moe import apply_expert_parallel
from lightning_moe_overlap.parallel.dtensors import local
from lightning_moe_overlap.parallelize.compile_regions import dense_regions
from lightning_moe_overlap.validation import check_config, raise_problems
from tests.helpers.data import RandomTokens
from tests.helpers.distributed import run_distributed


def _moegpt() -> MoEGPT:
    torch.manual_seed(0)
    return MoEGPT(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, num_experts=4, top_k=2,
                  ffn_hidden_size=16)  # fmt: skip


LAYER_REGIONS = ("self_attn", "mlp.gate", "mlp.shared_experts", "input_layernorm", "post_attention_layernorm")


def test_the_dense_regions_of_each_family() -> None:
    model = _moegpt()
    assert dense_regions(model) == []  # no expert-parallel experts yet: nothing marks a block
    apply_expert_parallel(model, None)
    layer = ["attn_norm", "attn", "mlp_norm"]  # the router (TopKRouter), the experts, the Linear head: not
    assert [n for n, _ in dense_regions(model)] == [f"layers.{i}.{m}" for i in range(2) for m in layer] + ["norm"]
    hf = HFMoECausalLM("deepseek_v3", config_overrides={"num_hidden_layers": 2, "first_k_dense_replace": 1})
    hf.configure_model()
    apply_expert_parallel(hf, None)
    names = [n.removeprefix("model.model.") for n, _ in dense_regions(hf)]
    assert names == [
        "layers.0",  # the dense layer, whole
        *(f"layers.1.{m}" for m in LAYER_REGIONS),
        "norm",
    ]


def test_compile_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match=r"`compile='yes'` is a str; .*Pass True or False \(default\)"):
        raise_problems(check_config(OverlapConfig(compile="yes")))  # type: ignore[arg-type]


def _fit(compile: bool, overlap: bool = True, callbacks: tuple = ()) -> dict:
    model = _moegpt()
    losses: list[torch.Tensor] = []
    grads: list[list[torch.Tensor]] = []
    model.on_train_batch_end = lambda outputs, *_: losses.append(outputs["loss"].detach().clone())
    model.on_before_optimizer_step = lambda optimizer: grads.append(  # plain tensors: they cross the process queue
        [local(p.grad).clone() for p in model.parameters() if p.grad is not None]
    )
    strategy = MoEOverlapStrategy(num_microbatches=2, overlap=overlap, compile=compile)
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=list(callbacks), strategy=strategy,
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=DataLoader(RandomTokens(32, 9, 128, seed=3), batch_size=4))
    prepared = strategy.prepared
    assert prepared is not None
    return {"losses": torch.stack(losses), "grads": grads, "compiled": prepared.compiled}


def _fits(rank: int, world: int) -> dict:
    """The fits, in a process of their own: a Trainer leaves its process group and ``MASTER_PORT`` behind."""
    counters.clear()
    eager = _fit(False)
    compiled = _fit(True)
    graphs = counters["stats"]["unique_graphs"]
    sequential = _fit(True, overlap=False)
    callbacks = (SelectiveRecompute(modules=["core_attn", "layernorm"]), ActivationOffload(modules=["expert_fc1"]))
    return {"eager": eager, "compiled": compiled, "graphs": graphs, "sequential": sequential,
            "with_callbacks": _fit(True, callbacks=callbacks)}  # fmt: skip


def test_a_compiled_fit_follows_the_eager_one_and_stays_bitwise_under_the_overlap() -> None:
    (got,) = run_distributed(_fits, 1, timeout_s=300)
    eager, compiled = got["eager"], got["compiled"]
    assert eager["compiled"] == () and len(compiled["compiled"]) == 7
    assert got["graphs"] >= 2  # the attention and the norm (one graph for every instance)
    # Inductor fuses the norms' and the attention's element-wise work and may reorder their sums (over 32 features,
    # 9 positions): float32 rounding of a few ulp per op, carried through 2 layers; 1e-5 relative is ~80 ulp.
    torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=1e-5, atol=0)
    for mine, want in zip(compiled["grads"][0], eager["grads"][0], strict=True):
        torch.testing.assert_close(mine, want, rtol=0, atol=1e-5 * float(want.abs().max()))
    # The same compiled code in every schedule: overlapped, sequential, and with the memory callbacks around it.
    for other in (got["sequential"], got["with_callbacks"]):
        assert torch.equal(other["losses"], compiled["losses"])
        for mine, want in zip(other["grads"], compiled["grads"], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(mine, want, strict=True))
