"""The tensor-parallel plans alone (no strategy) on 2 gloo ranks at tp=2: every gradient, summed as the strategy
sums them, equals the unsplit model's in one process on the same tokens (MoEGPT with its balancing loss and shared
expert, HF Qwen3-MoE from the plan the model carries); and a sequence tp does not divide is refused by name."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.demo_hf import HFMoECausalLM
from lightning_moe_overlap.parallel.tensor import (
    TensorParallelGrads,
    apply_tensor_parallel,
    plan_of,
    set_sequence_group,
)
from tests.helpers.distributed import run_distributed

GPT = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_experts=4, top_k=2, ffn_hidden_size=16,
           shared_expert_ffn_hidden_size=16, aux_loss_coeff=1e-1)  # fmt: skip


def _build(kind: str):
    if kind == "gpt":
        return MoEGPT(**GPT, seed=3), lambda m, t: m._loss(t), 9
    torch.manual_seed(3)
    return HFMoECausalLM(model_type="qwen3_moe"), lambda m, t: m.model(input_ids=t, labels=t).loss, 8


def _worker(rank: int, world: int, kind: str) -> dict:
    torch.set_num_threads(1)
    reference, loss_of, seq = _build(kind)
    model, _, _ = _build(kind)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    apply_tensor_parallel(model, mesh, plan_of(model, mesh))
    set_sequence_group(model, mesh.get_group())
    grads = TensorParallelGrads.of(model, mesh.get_group())
    tokens = torch.randint(0, 64, (2, seq), generator=torch.Generator().manual_seed(1))
    loss_of(reference, tokens).backward()
    loss = loss_of(model, tokens)
    loss.backward()
    grads.reduce(model)
    diffs = {}
    for name, p in model.named_parameters():
        got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        diffs[name] = (got - reference.get_parameter(name).grad).abs().max().item()
    sharded = sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor))
    with pytest.raises(ValueError, match=rf"got a sequence of {seq - 2 if kind == 'gpt' else seq - 1} tokens .*tp=2 does not divide"):
        loss_of(model, tokens[:, : seq - 1])
    return {"diffs": diffs, "sharded": sharded, "summed": list(grads.names), "loss": float(loss)}


@pytest.mark.parametrize("kind", ["gpt", "qwen3"])
def test_tp2_gradients_equal_the_unsplit_model(kind):
    results = run_distributed(_worker, 2, kind, timeout_s=120)
    for r in results:
        assert max(r["diffs"].values()) < 1e-6, {k: v for k, v in r["diffs"].items() if v >= 1e-6}
        assert r["sharded"] and r["summed"]  # both kinds of parameters are there
    assert results[0]["loss"] == results[1]["loss"]  # the full logits: the same loss on both tp ranks
    if kind == "qwen3":
        assert any("q_proj" in n for n in results[0]["sharded"]) and any("mlp.gate.weight" in n for n in results[0]["summed"])


def _fused_worker(rank: int, world: int, kind: str) -> str:
    torch.set_num_threads(1)
    if kind == "gpt":
        model, seq = MoEGPT(**GPT, seed=3, fused_cross_entropy=True), 9
        loss_of = lambda m, t: m._loss(t)  # noqa: E731
    else:
        model, seq = HFMoECausalLM(model_type="qwen3_moe", fused_cross_entropy=True), 8
        loss_of = lambda m, t: m._hf_loss(t)  # noqa: E731
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    apply_tensor_parallel(model, mesh, plan_of(model, mesh))
    tokens = torch.randint(0, 64, (2, seq), generator=torch.Generator().manual_seed(1))
    with pytest.raises(NotImplementedError, match=r"LM head's weight is a DTensor .*Fix: `fused_cross_entropy=False` at tp > 1"):
        loss_of(model, tokens)
    return "refused"


@pytest.mark.parametrize("kind", ["gpt", "qwen3"])
def test_the_fused_cross_entropy_is_refused_at_tp2_with_the_fix(kind):
    assert run_distributed(_fused_worker, 2, kind, timeout_s=120) == ["refused", "refused"]
