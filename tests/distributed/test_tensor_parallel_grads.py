"""The tensor-parallel plans alone (no strategy) on 2 gloo ranks at tp=2: every gradient, summed as the strategy
sums them, equals the unsplit model's in one process on the same tokens (MoEGPT with its balancing loss and shared
expert, HF Qwen3-MoE from the plan the model carries), with the loss over the vocabulary-sharded logits under torch's
``loss_parallel`` (no rank holds the [B, S, V] logits) and with the fused cross-entropy over the head's rows; and a
sequence tp does not divide is refused by name."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel

from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.demo_hf import HFMoECausalLM
from lightning_moe_overlap.loss import fused_linear_cross_entropy
from lightning_moe_overlap.loss.vocab_parallel import head_cross_entropy
from lightning_moe_overlap.parallel.tp_styles import apply_tensor_parallel
from lightning_moe_overlap.parallelize.tensor_plan import TensorParallelGrads, plan_of, set_sequence_group
from tests.helpers.distributed import run_distributed

GPT = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_experts=4, top_k=2, ffn_hidden_size=16,
           shared_expert_ffn_hidden_size=16, aux_loss_coeff=1e-1)  # fmt: skip


def _build(kind: str, fused: bool = False):
    """The model, its loss as its training step computes it, and the sequence length (one shifted token for MoEGPT)."""
    if kind == "gpt":
        return MoEGPT(**GPT, seed=3, fused_cross_entropy=fused), lambda m, t: m._loss(t), 9
    torch.manual_seed(3)
    return HFMoECausalLM(model_type="qwen3_moe", fused_cross_entropy=fused), lambda m, t: m._hf_loss(t), 8


def _head(model: torch.nn.Module) -> torch.nn.Module:
    return model.head if isinstance(model, MoEGPT) else model.model.lm_head


def _worker(rank: int, world: int, kind: str, fused: bool) -> dict:
    torch.set_num_threads(1)
    reference, loss_of, seq = _build(kind)  # the unsplit model, its loss from the whole logits
    model, _, _ = _build(kind, fused)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    apply_tensor_parallel(model, mesh, plan_of(model, mesh))
    set_sequence_group(model, mesh.get_group())
    grads = TensorParallelGrads.of(model, mesh.get_group())
    logit_shapes: list[tuple] = []  # every output of the head: its global and this rank's shape
    _head(model).register_forward_hook(
        lambda m, a, out: logit_shapes.append((tuple(out.shape), tuple(out.to_local().shape)))
    )
    tokens = torch.randint(0, 64, (2, seq), generator=torch.Generator().manual_seed(1))
    ref_loss = loss_of(reference, tokens)
    ref_loss.backward()
    if not fused:  # the sharded logits' cross-entropy outside loss_parallel: refused with the fix
        with pytest.raises(RuntimeError, match=r"is a DTensor .*`loss_parallel` is not entered.*Fix: run the step"):
            loss_of(model, tokens)
    with loss_parallel():  # as the strategy enters it around a step's forwards and backwards
        loss = loss_of(model, tokens)
        loss.backward()
    grads.reduce(model)
    diffs = {}
    for name, p in model.named_parameters():
        got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        diffs[name] = (got - reference.get_parameter(name).grad).abs().max().item()
    sharded = sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor))
    short = seq - 2 if kind == "gpt" else seq - 1
    refused = rf"rule `tp-divides-sequence`.*got a sequence of {short} tokens .*tp=2 does not divide"
    with loss_parallel(), pytest.raises(ValueError, match=refused):
        loss_of(model, tokens[:, : seq - 1])
    return {"diffs": diffs, "sharded": sharded, "summed": list(grads.names), "loss": loss.item(),
            "ref_loss": ref_loss.item(), "plain": type(loss) is torch.Tensor, "logit_shapes": logit_shapes}  # fmt: skip


@pytest.mark.parametrize("fused", [False, True], ids=["loss_parallel", "fused"])
@pytest.mark.parametrize("kind", ["gpt", "qwen3"])
def test_tp2_gradients_equal_the_unsplit_model(kind, fused):
    results = run_distributed(_worker, 2, kind, fused, timeout_s=120)
    for r in results:
        assert max(r["diffs"].values()) < 1e-5, {k: v for k, v in r["diffs"].items() if v >= 1e-5}
        assert abs(r["loss"] - r["ref_loss"]) < 1e-5 and r["plain"]  # a plain tensor, as Lightning logs it
        assert r["sharded"] and r["summed"]  # both kinds of parameters are there
        # no [B, S, V] logits on a rank: the head's output holds V / tp columns; fused: MoEGPT never calls the
        # head, HF's forward calls it on one position per rank
        assert r["logit_shapes"] or (fused and kind == "gpt"), "the head ran"
        for global_shape, local_shape in r["logit_shapes"]:
            assert local_shape[-1] == global_shape[-1] // 2 and local_shape[:-1] == global_shape[:-1]
            if fused:
                assert global_shape[1] == 2  # HF's forward keeps one position on each tp rank
    assert results[0]["loss"] == results[1]["loss"]  # the same loss on both tp ranks
    if kind == "qwen3":
        assert any("q_proj" in n for n in results[0]["sharded"])
        assert any("mlp.gate.weight" in n for n in results[0]["summed"])


def _refusal_worker(rank: int, world: int) -> list[str]:
    """A DTensor head the fused loss cannot split, and a DTensor weight passed to the plain fused function."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    hidden, target = torch.randn(2, 4, 8), torch.randint(0, 6, (2, 4))
    weight = torch.randn(6, 8)
    replicated = distribute_tensor(weight, mesh, [Replicate()])
    uneven = distribute_tensor(torch.randn(5, 8), mesh, [Shard(0)])  # tp=2 does not divide 5 rows
    for head in (replicated, uneven):
        with pytest.raises(NotImplementedError, match=r"LM head's weight is a DTensor .*Fix: plan the head with"):
            head_cross_entropy(hidden, head, target)
    with pytest.raises(NotImplementedError, match=r"is a DTensor .*Fix: call .*head_cross_entropy"):
        fused_linear_cross_entropy(hidden, distribute_tensor(weight, mesh, [Shard(0)]), target)
    with pytest.raises(ValueError, match=r"hidden states \[2, 3, 8\] for targets \[2, 4\] at tp=2"):
        head_cross_entropy(hidden[:, :3], distribute_tensor(weight, mesh, [Shard(0)]), target)
    return ["refused"]


def test_heads_the_fused_loss_cannot_split_are_refused_with_the_fix():
    assert run_distributed(_refusal_worker, 2, timeout_s=60) == [["refused"], ["refused"]]
