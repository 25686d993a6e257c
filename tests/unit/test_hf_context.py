"""The pieces of ``hf/context.py`` that need no process group. Oracles: HF's own ``sdpa`` attention and its
``load_balancing_loss_func`` on the whole batch; the cp=2 x ep=2 training runs in
tests/distributed/test_context_parallel_hf.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func  # noqa: E402

from lightning_moe_overlap.demo_hf import HFMoECausalLM, build_hf_model  # noqa: E402
from lightning_moe_overlap.hf.context import (  # noqa: E402
    ATTENTION,
    balancing_loss_from,
    check_batch,
    ring_sdpa_attention,
    router_statistics,
    use_ring_attention,
)
from lightning_moe_overlap.parallel.context_batch import shard_sequence  # noqa: E402
from tests.helpers.tolerance import reordered_sum_tol, softmax_tol  # noqa: E402


def test_the_ring_attention_is_hf_sdpa_without_a_mask_and_set_per_model():
    torch.manual_seed(0)
    model, other = build_hf_model("qwen3_moe"), build_hf_model("qwen3_moe")  # GQA: 4 query heads, 2 key/value
    ids_BT = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    want = model(input_ids=ids_BT).logits
    use_ring_attention(model)
    use_ring_attention(model)  # idempotent
    assert model.config._attn_implementation == ATTENTION and other.config._attn_implementation == "sdpa"
    torch.testing.assert_close(model(input_ids=ids_BT).logits, want, rtol=1e-6, atol=1e-6)
    # head-tail shard positions (0, 1, 6, 7) jump: with sdpa HF would read them as packed sequences; here no mask
    positions = torch.tensor([[0, 1, 6, 7]])
    model(input_ids=ids_BT[:, [0, 1, 6, 7]], position_ids=positions)


def test_the_ring_attention_refuses_a_mask_and_a_cache():
    module = torch.nn.Module()
    q, k = torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 6, 8)
    with pytest.raises(NotImplementedError, match=r"got an attention mask of shape \[1, 1, 4, 4\].*Rule: at cp > 1"):
        ring_sdpa_attention(module, q, q, q, torch.ones(1, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match=r"4 queries against 6 keys \(a cache\).*Fix: train without"):
        ring_sdpa_attention(module, q, k, k, None)
    with pytest.raises(NotImplementedError, match=r"sliding_window=3"):
        ring_sdpa_attention(module, q, q, q, None, sliding_window=3)


def test_a_padded_mask_and_packed_positions_are_refused():
    ids_BT = torch.zeros(2, 8, dtype=torch.long)
    check_batch({"input_ids": ids_BT, "attention_mask": torch.ones(2, 8)}, 2)  # no padding: fine
    check_batch({"input_ids": ids_BT, "position_ids": torch.arange(8).expand(2, 8)}, 2)
    mask = torch.ones(2, 8)
    mask[0, -2:] = 0
    with pytest.raises(ValueError, match=r"cp=2: the batch's attention_mask \[2, 8\] marks 2 padding .*cp-hf-batch"):
        check_batch({"input_ids": ids_BT, "attention_mask": mask}, 2)
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    with pytest.raises(ValueError, match=r"position_ids \[1, 8\] are not 0..7 .*Fix: leave position_ids out"):
        check_batch({"input_ids": ids_BT[:1], "position_ids": packed}, 2)


@pytest.mark.parametrize("cp", [2, 4])
def test_the_cp_ranks_balancing_loss_shares_average_to_hf_s(cp):
    """Router logits of a [B, T] micro-batch, two layers; each cp rank's rows are its head-tail shard."""
    g = torch.Generator().manual_seed(cp)
    B, T, E, K = 2, 16, 8, 2
    layers_BTE = [torch.randn(B, T, E, generator=g, requires_grad=True) for _ in range(2)]
    want = load_balancing_loss_func(tuple(x.reshape(-1, E) for x in layers_BTE), E, K)
    want_grads = torch.autograd.grad(want, layers_BTE)
    stats = [
        router_statistics(tuple(shard_sequence(x, cp, r).reshape(-1, E) for x in layers_BTE), E, K) for r in range(cp)
    ]
    counts_E = sum(s[0] for s in stats)  # what the all-reduce over the cp group sums
    rows = sum(s[2] for s in stats)
    shares = [balancing_loss_from(counts_E, probs_E, rows, E, cp) for _, probs_E, _ in stats]
    got = torch.stack(shares).mean()  # the gradient mean over cp
    # float32, in other orders (ATEN_CPU_CAPABILITY): each row's softmax over E (the logits given: width 0), then
    # sums of positive terms over the 2 * B * T rows (per shard, then over the shards), the E products and the
    # scale (+4: counts / rows, probs / rows, the factor, the mean over cp): relatively (tests/helpers/tolerance.py).
    max_logit = max(x.detach().abs().max().item() for x in layers_BTE)
    rel = softmax_tol(E, max_logit, 0) + reordered_sum_tol(2 * B * T + E + 4, 1.0)
    torch.testing.assert_close(got, want, rtol=rel, atol=0)
    # The gradient: that, and the softmax's backward sums E products more; entries summed from terms of both signs
    # relative to the largest entry (a proxy for the sum of the terms' absolute values).
    rel_grad = rel + reordered_sum_tol(E, 1.0)
    for g_got, g_want in zip(torch.autograd.grad(got, layers_BTE), want_grads):
        torch.testing.assert_close(g_got, g_want, rtol=rel_grad, atol=rel_grad * g_want.abs().max().item())


def test_hf_module_declares_the_attribute_unset():
    assert HFMoECausalLM("qwen3_moe").context_parallel is None


@pytest.mark.parametrize("qk_dim, v_dim", [(8, 4), (4, 8), (6, 6)])
def test_the_ring_attention_takes_values_of_another_width_than_the_queries(qk_dim, v_dim):
    """Multi-head latent attention (DeepSeek-V3) has values narrower than its queries and keys; the kernel the ring
    runs takes one width, so the narrower side is padded with zero columns and the output cut back. Against causal
    attention written out (softmax of the scaled scores, times the values): one reordered dot product apart."""
    from lightning_moe_overlap.hf.context import ring_sdpa_attention

    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 2, 5, qk_dim, generator=gen), torch.randn(2, 2, 5, qk_dim, generator=gen)
    v = torch.randn(2, 2, 5, v_dim, generator=gen)
    scale = 0.3
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    want_BSHD = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)
    got_BSHD, weights = ring_sdpa_attention(torch.nn.Module(), q, k, v, None, scaling=scale)
    assert weights is None and got_BSHD.shape == want_BSHD.shape
    # a score is a reordered dot product (error delta); softmax turns it into a relative error of each weight of at
    # most 2 delta (with the normaliser's), and the weighted sum of 5 values adds its own reordering
    delta = float(reordered_sum_tol(qk_dim, float((q.abs() @ k.abs().transpose(-1, -2)).max()) * scale))
    v_max = float(v.abs().max())
    tol = 4 * delta * v_max + float(reordered_sum_tol(5, v_max)) + 4 * torch.finfo(torch.float32).eps * v_max
    torch.testing.assert_close(got_BSHD, want_BSHD, rtol=0, atol=tol)
