"""Hugging Face transformers v5 MoE models made expert-parallel (ep=2 on gloo) match the unsharded model.

Tiny models are built from configs (random weights, no download). On each rank, the unsharded model and its
expert-parallel copy run the rank's own tokens: logits and the gradients of every non-expert parameter must
match on that rank, and the expert gradients, gathered over the ep group, must equal the unsharded gradients
summed over the ep group (each rank's experts also serve the other rank's tokens).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from lightning_moe_overlap.moe import ExpertParallelExperts, apply_expert_parallel, find_moe_blocks
from lightning_moe_overlap.overlap.runtime import CommRuntime
from tests.helpers.distributed import run_distributed

COMMON = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
}


def _models() -> dict:
    from transformers import (
        GptOssConfig,
        GptOssForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    return {
        "qwen3_moe": (
            Qwen3MoeForCausalLM,
            Qwen3MoeConfig(
                intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, **COMMON
            ),
        ),
        "mixtral": (
            MixtralForCausalLM,
            MixtralConfig(intermediate_size=16, num_local_experts=8, num_experts_per_tok=2, **COMMON),
        ),
        "qwen2_moe": (
            Qwen2MoeForCausalLM,
            Qwen2MoeConfig(
                intermediate_size=64,
                moe_intermediate_size=16,
                shared_expert_intermediate_size=32,
                num_experts=8,
                num_experts_per_tok=2,
                **COMMON,
            ),
        ),
        "gpt_oss": (
            GptOssForCausalLM,
            GptOssConfig(intermediate_size=16, num_local_experts=8, num_experts_per_tok=2, head_dim=8, **COMMON),
        ),
    }


def _build(cls, config, dtype: torch.dtype, experts_impl: str) -> torch.nn.Module:
    config._experts_implementation = experts_impl  # HF's grouped_mm kernel has no float64
    torch.manual_seed(0)
    model = cls(config).to(dtype)
    with torch.no_grad():
        for p in model.parameters():  # some HF inits leave routers/biases at zero: make routing non-trivial
            if p.abs().sum() == 0:
                p.normal_(0.0, 0.2)
    return model


def _compare(
    rank: int, group: dist.ProcessGroup, name: str, dtype: torch.dtype, experts_impl: str, dispatcher: str
) -> None:
    cls, config = _models()[name]
    ref = _build(cls, copy.deepcopy(config), dtype, experts_impl)
    model = copy.deepcopy(ref)
    wrapped = apply_expert_parallel(model, group, dispatcher=dispatcher, runtime=CommRuntime())
    assert len(wrapped) == 2 and not find_moe_blocks(model)  # both layers swapped, nothing left unsharded
    ids = torch.randint(0, 128, (2, 5 + rank), generator=torch.Generator().manual_seed(rank))
    out_ref, out = ref(ids).logits, model(ids).logits
    tol = {"atol": 1e-10, "rtol": 1e-10} if dtype == torch.float64 else {}
    torch.testing.assert_close(out, out_ref, **tol, msg=f"{name} logits")
    out_ref.float().square().mean().backward()
    out.float().square().mean().backward()
    experts = {id(p) for m in wrapped for p in m.parameters()}
    for (pname, p_ref), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
        if p_ref.grad is None:
            assert p.grad is None, pname
            continue
        if id(p) in experts:
            parts = [torch.empty_like(p.grad) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, p.grad, group=group)
            want = p_ref.grad.clone()
            dist.all_reduce(want, group=group)
            torch.testing.assert_close(torch.cat(parts), want, **tol, msg=f"{name} {pname}")
        else:
            torch.testing.assert_close(p.grad, p_ref.grad, **tol, msg=f"{name} {pname}")
    shard = next(m for m in model.modules() if isinstance(m, ExpertParallelExperts)).expert_shard
    assert shard.first_expert == dist.get_rank(group) * 4 and shard.num_local == 4


def hf_worker(rank: int, world_size: int) -> list[str]:
    group = dist.group.WORLD
    done = []
    for name in ("qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss"):
        _compare(rank, group, name, torch.float64, "eager", "alltoall")
        done.append(f"{name}-float64")
    # float32 against HF's own default grouped_mm path, and the allgather dispatcher.
    _compare(rank, group, "qwen3_moe", torch.float32, "grouped_mm", "allgather")
    done.append("qwen3_moe-float32-allgather")
    # A block whose experts ep does not divide: every rank fails the same way, before any collective.
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    odd = Qwen3MoeForCausalLM(
        Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=16, num_experts=3, num_experts_per_tok=2, **COMMON)
    )
    with pytest.raises(ValueError, match=r"num_experts=3 is not divisible by ep=2.*Choose ep among \[1, 3\]"):
        apply_expert_parallel(odd, group, runtime=CommRuntime())
    assert find_moe_blocks(odd) == {"model.layers.0.mlp.experts": 3, "model.layers.1.mlp.experts": 3}  # untouched
    done.append("odd-experts-error")
    return done


def test_hf_models_expert_parallel_match_unsharded() -> None:
    results = run_distributed(hf_worker, 2, timeout_s=120)
    assert results[0] == results[1] and len(results[0]) == 6
