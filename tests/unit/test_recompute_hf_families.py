"""Full-layer recompute on every built-in HF v5 MoE family: the same losses, gradients and router statistics as the
run without it (the model's own forward, no checkpoint), with the overlap engine on and off, at ep=1.

The HF layers are called with the model's KV cache (``use_cache`` defaults to true in training); a recomputation
must neither append to it again nor read what the forward appended (DeepSeek-V3's MLA saves tensors whose length
is the cache's).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from lightning_moe_overlap.callbacks import SelectiveRecompute
from lightning_moe_overlap.moe.ep import apply_expert_parallel
from lightning_moe_overlap.moe.bias import correction_bias_balancers
from lightning_moe_overlap.overlap.engine import OverlapEngine
from lightning_moe_overlap.overlap.runtime import CommRuntime
from tests.unit.test_recompute import one_thread  # noqa: F401 (module fixture: one torch thread)

tf = pytest.importorskip("transformers")

VOCAB, MICRO, STEPS = 64, 2, 2
COMMON = {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
          "vocab_size": VOCAB}


def _configs() -> dict[str, tuple[type, object]]:
    return {
        "qwen3_moe": (tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(
            intermediate_size=32, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2, head_dim=8, **COMMON)),
        "mixtral": (tf.MixtralForCausalLM, tf.MixtralConfig(
            intermediate_size=8, num_local_experts=4, num_experts_per_tok=2, head_dim=8, **COMMON)),
        "olmoe": (tf.OlmoeForCausalLM, tf.OlmoeConfig(
            intermediate_size=8, num_experts=4, num_experts_per_tok=2, pad_token_id=1, eos_token_id=0, **COMMON)),
        "qwen2_moe": (tf.Qwen2MoeForCausalLM, tf.Qwen2MoeConfig(
            intermediate_size=32, moe_intermediate_size=8, shared_expert_intermediate_size=16, num_experts=4,
            num_experts_per_tok=2, **COMMON)),
        "deepseek_v3": (tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config(  # both layers MoE, one shared expert, MLA
            intermediate_size=32, moe_intermediate_size=8, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
            topk_group=1, n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=8, q_lora_rank=8,
            qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, **COMMON)),
        "gpt_oss": (tf.GptOssForCausalLM, tf.GptOssConfig(
            intermediate_size=8, num_local_experts=4, num_experts_per_tok=2, head_dim=8, **COMMON)),
    }


def build(name: str, ep_group=None, runtime: CommRuntime | None = None) -> nn.Module:
    """A tiny HF model of family ``name`` (double precision, non-trivial routing), its experts expert-parallel over
    ``ep_group`` (all of them in this process when None)."""
    cls, config = _configs()[name]
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = cls(config).double().train()
    with torch.no_grad():
        for p in model.parameters():
            if p.abs().sum() == 0:  # zero-initialised routers and biases: make routing non-trivial
                p.normal_(0.0, 0.2)
    apply_expert_parallel(model, ep_group, runtime=runtime or CommRuntime())
    return model


def train(name: str, recompute: SelectiveRecompute | None, overlap: bool | None) -> dict[str, list]:
    """``STEPS`` SGD steps of ``MICRO`` micro-batches (through the engine unless ``overlap`` is None); returns the
    losses, the gradients, the tokens counted per expert and the correction biases of every step."""
    model = build(name)
    balancers = correction_bias_balancers(model)
    if recompute is not None:
        recompute.apply(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = None if overlap is None else OverlapEngine(CommRuntime(), overlap=overlap, timeout_s=30)
    g = torch.Generator().manual_seed(0)
    seen: dict[str, list] = {"loss": [], "grads": [], "counts": [], "bias": []}
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (MICRO, 2, 8), generator=g)
        opt.zero_grad()

        caches = {}

        def forward(i: int, t: Tensor = tokens) -> Tensor:
            out = model(input_ids=t[i], labels=t[i])
            caches[i] = out.cache if hasattr(out, "cache") else out.past_key_values
            seen["loss"].append(out.loss.detach().clone())
            return out.loss

        def backward(i: int, loss: Tensor) -> None:
            (loss / MICRO).backward()
            assert caches.pop(i).get_seq_length() == 8  # the recomputation did not append to the forward's cache

        if engine is None:
            for i in range(MICRO):
                backward(i, forward(i))
        else:
            engine.run(forward, backward, MICRO)
        seen["grads"].append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        seen["counts"].append([b.counts_E.clone() for b in balancers])
        for b in balancers:
            b.update()
        seen["bias"].append([b.router.e_score_correction_bias.clone() for b in balancers])
        opt.step()
    if recompute is not None:
        assert recompute._handles  # the comparison is not vacuous: the layers were checkpointed
        recompute.remove()
    return seen


def same(a: list, b: list) -> bool:
    if isinstance(a, Tensor):
        return torch.equal(a, b)
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "deepseek_v3", "gpt_oss"]
CASES = [  # (recompute, overlap): None runs the micro-batches one after the other without the engine
    (lambda: SelectiveRecompute(granularity="full"), None),
    (lambda: SelectiveRecompute(granularity="full"), True),
    (lambda: SelectiveRecompute(granularity="full", num_layers=2), False),
    (lambda: SelectiveRecompute(granularity="full", method="block", num_layers=1), True),
]


@pytest.mark.parametrize("name", FAMILIES)
def test_full_recompute_matches_the_run_without_it(name: str) -> None:
    reference = train(name, None, None)
    if name == "deepseek_v3":  # the balancer counted tokens and moved the bias: its comparison is not vacuous
        assert reference["counts"][0] and all(int(c.sum()) == MICRO * 2 * 8 * 2 for c in reference["counts"][0])
        assert all(bool(b.abs().sum() > 0) for b in reference["bias"][0])
    for make, overlap in CASES:
        recompute = make()
        got = train(name, recompute, overlap)
        for key in ("loss", "grads", "counts", "bias"):
            assert same(got[key], reference[key]), (name, recompute, overlap, key)
