"""``TopKRouter`` against plain torch reimplementations of each routing mode, its losses and the expert bias."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from lightning_moe_overlap.moe import TopKRouter
from tests.helpers.tolerance import reordered_sum_tol, softmax_tol

T, D, E = 12, 16, 8


def _router(**kwargs) -> TopKRouter:
    torch.manual_seed(0)
    router = TopKRouter(D, E, kwargs.pop("top_k", 2), **kwargs).double()
    with torch.no_grad():
        router.weight.normal_(0.0, 1.0)
    return router


def _as_dense(weights_TK: Tensor, indices_TK: Tensor) -> Tensor:
    """``[T, E]`` with each token's weights at its experts (order of the k choices does not matter)."""
    return torch.zeros(weights_TK.shape[0], E, dtype=weights_TK.dtype).scatter(1, indices_TK, weights_TK)


def _x() -> Tensor:
    return torch.randn(T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _scores_rtol(logits: Tensor, k: int = 2) -> float:
    """The router's weights against the float64 references, relatively: megatron-core computes the routing scores in
    float32 from the float64 logits (rounded once: ``softmax_tol`` with ``width=0``, over the ``E`` experts; a
    sigmoid is one ``exp``, an add and a division, within that too), then renormalises the top ``k`` (a sum of ``k``
    positive terms and a division) or scales them (+1). The float64 references' own rounding (``n * 2**-53``) is
    negligible next to it."""
    return softmax_tol(E, logits.detach().abs().max().item(), 0) + reordered_sum_tol(k + 2, 1.0)


def test_softmax_topk_matches_hf_style_softmax_topk_renormalise() -> None:
    router = _router()
    x = _x()
    logits, weights, indices = router(x)
    probs = torch.softmax(x @ router.weight.T, dim=-1)
    top, idx = probs.topk(2, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    torch.testing.assert_close(logits, x @ router.weight.T)
    rtol = _scores_rtol(logits)
    torch.testing.assert_close(_as_dense(weights, indices), _as_dense(top, idx), rtol=rtol, atol=0)
    assert indices.dtype == torch.long and weights.shape == (T, 2)


def test_pre_softmax_keeps_unnormalised_probabilities() -> None:
    router = _router(pre_softmax=True, scaling_factor=2.5)
    x = _x()
    logits, weights, indices = router(x)
    top, idx = torch.softmax(x @ router.weight.T, dim=-1).topk(2, dim=-1)
    rtol = _scores_rtol(logits)
    torch.testing.assert_close(_as_dense(weights, indices), _as_dense(2.5 * top, idx), rtol=rtol, atol=0)


def test_sigmoid_group_limited_with_expert_bias_matches_deepseek_v3() -> None:
    router = _router(top_k=2, score_function="sigmoid", num_groups=4, group_topk=2, enable_expert_bias=True)
    router.expert_bias.copy_(torch.linspace(-0.3, 0.3, E))
    x = _x()
    logits, weights, indices = router(x)
    # DeepSeek-V3 (HF DeepseekV3TopkRouter without the fixed top-2-per-group, here top-k/group_topk = 1 per group).
    scores = torch.sigmoid(x @ router.weight.T)
    choice = scores + router.expert_bias
    group_scores = choice.view(T, 4, E // 4).topk(1, dim=-1)[0].sum(-1)
    keep = torch.zeros(T, 4).scatter(1, group_scores.topk(2, dim=-1)[1], 1.0).bool()
    masked = choice.masked_fill(~keep.repeat_interleave(E // 4, dim=1), float("-inf"))
    idx = masked.topk(2, dim=-1)[1]
    top = scores.gather(1, idx)
    top = top / (top.sum(-1, keepdim=True) + 1e-20)
    rtol = _scores_rtol(logits)
    torch.testing.assert_close(_as_dense(weights, indices), _as_dense(top, idx), rtol=rtol, atol=0)
    # Selected experts lie in exactly the kept groups, and the bias changed the selection somewhere.
    unbiased = torch.sigmoid(x @ router.weight.T)
    assert not torch.equal(idx.sort(-1).values, unbiased.topk(2, -1)[1].sort(-1).values)


def test_load_balancing_loss_value_and_gradient() -> None:
    router = _router(aux_loss_coeff=0.1)
    x = _x().requires_grad_()
    router.aux_loss_scale = 0.5
    _, weights, _ = router(x)
    # d(sum(weights * 0)) is zero, so all gradient comes from the aux loss, scaled by aux_loss_scale.
    (weights * 0).sum().backward()
    got = router.weight.grad.clone()

    def reference_loss(w: Tensor) -> Tensor:
        probs = torch.softmax(x.detach() @ w.T, dim=-1)
        counts = torch.zeros(T, E, dtype=probs.dtype).scatter(1, probs.topk(2, -1)[1], 1.0).sum(0)
        return 0.1 * E / (2 * T * T) * (probs.sum(0) * counts).sum()

    w = router.weight.detach().clone().requires_grad_()
    loss = reference_loss(w)
    (0.5 * loss).backward()
    # megatron-core computes the aux-loss scores in float32 (each within `_scores_rtol`), then sums them over the T
    # tokens, multiplies by the counts and sums over the E experts, all positive terms (+2: the coefficient and the
    # division): relatively.
    rtol = _scores_rtol(x @ w.detach().T) + reordered_sum_tol(T + E + 2, 1.0)
    torch.testing.assert_close(router.metrics["load_balancing_loss"].double(), loss.detach(), rtol=rtol, atol=0)
    torch.testing.assert_close(got, w.grad, rtol=1e-4, atol=1e-8)


def test_z_loss_gradient_flows_through_logits() -> None:
    router = _router(z_loss_coeff=0.01)
    x = _x()
    _, weights, _ = router(x)
    (weights * 0).sum().backward()
    w = router.weight.detach().clone().requires_grad_()
    z = 0.01 * torch.logsumexp(x @ w.T, dim=-1).square().mean()
    z.backward()
    torch.testing.assert_close(router.metrics["z_loss"], z.detach())
    torch.testing.assert_close(router.weight.grad, w.grad)


def test_losses_are_off_in_eval_and_under_no_grad() -> None:
    router = _router(aux_loss_coeff=0.1, z_loss_coeff=0.1)
    router.eval()
    router(_x())
    router.train()
    with torch.no_grad():
        router(_x())
    assert router.metrics == {}


def test_update_expert_bias_moves_towards_balance_and_resets_counts() -> None:
    router = _router(score_function="sigmoid", enable_expert_bias=True, expert_bias_update_rate=0.01)
    _, _, indices = router(_x())
    counts = torch.bincount(indices.flatten(), minlength=E)
    assert torch.equal(router.local_tokens_per_expert, counts)
    router.update_expert_bias()
    expected = torch.sign(counts.double().mean() - counts.double()) * 0.01
    torch.testing.assert_close(router.expert_bias, expected.float())
    assert router.local_tokens_per_expert.sum() == 0


def test_expert_bias_stays_float32_under_dtype_casts() -> None:
    router = _router(score_function="sigmoid", enable_expert_bias=True).to(torch.bfloat16)
    assert router.weight.dtype == torch.bfloat16 and router.expert_bias.dtype == torch.float32


def test_no_counting_in_eval() -> None:
    router = _router(score_function="sigmoid", enable_expert_bias=True)
    router.eval()
    router(_x())
    assert router.local_tokens_per_expert.sum() == 0


def test_update_expert_bias_without_bias_raises() -> None:
    with pytest.raises(RuntimeError, match="enable_expert_bias=False, so it has no bias to update"):
        _router().update_expert_bias()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"score_function": "relu"}, ValueError, "score_function='relu' is not 'softmax' or 'sigmoid'"),
        ({"top_k": 9}, ValueError, r"top_k=9 with num_experts=8; the rule is 1 <= top_k <= num_experts"),
        ({"top_k": 0}, ValueError, r"the rule is 1 <= top_k"),
        ({"num_groups": 4}, ValueError, "needs both or neither"),
        ({"num_groups": 3, "group_topk": 1}, ValueError, r"num_experts % num_groups == 0"),
        ({"num_groups": 4, "group_topk": 5}, ValueError, r"1 <= group_topk <= num_groups"),
        ({"top_k": 3, "num_groups": 4, "group_topk": 2}, ValueError, r"top_k % group_topk == 0"),
        # E=8 in 4 groups of 2: top-4 from one group would need 4 experts in it (megatron's top-k fails inside)
        (
            {"top_k": 4, "num_groups": 4, "group_topk": 1},
            ValueError,
            (
                r"top_k // group_topk = 4 .* holds num_experts // num_groups = 2 .*top_k // group_topk <= "
                r"num_experts // num_groups. Keep more groups \(group_topk >= 2\)"
            ),
        ),
        ({"top_k": 6, "num_groups": 4, "group_topk": 2}, ValueError, r"group_topk >= 3"),
        ({"enable_expert_bias": True}, NotImplementedError, "applies the expert bias only to sigmoid scores"),
    ],
)
def test_router_validation(kwargs: dict, error: type[Exception], match: str) -> None:
    top_k = kwargs.pop("top_k", 2)
    with pytest.raises(error, match=match):
        TopKRouter(D, E, top_k, **kwargs)


def test_router_expert_bias_counts_once_under_activation_checkpointing():
    from torch.utils.checkpoint import checkpoint

    from lightning_moe_overlap.moe.layer import MoELayer

    torch.manual_seed(0)
    layer = MoELayer(
        hidden_size=8, ffn_hidden_size=8, num_experts=4, top_k=2, enable_expert_bias=True, score_function="sigmoid"
    )
    x = torch.randn(10, 8, requires_grad=True)
    layer(x).sum().backward()
    plain = layer.gate.local_tokens_per_expert.clone()
    layer.gate.local_tokens_per_expert.zero_()
    for reentrant in (False, True):  # the recompute runs the router again, inside backward
        checkpoint(layer, x, use_reentrant=reentrant).sum().backward()
        assert torch.equal(layer.gate.local_tokens_per_expert, plain)
        layer.gate.local_tokens_per_expert.zero_()
    assert int(plain.sum()) == 10 * 2
