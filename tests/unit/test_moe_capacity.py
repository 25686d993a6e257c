"""Capacity dropping against a brute-force reference, and its effect inside the MoE layer."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_moe_overlap.moe import MoELayer, drop_over_capacity, expert_capacity

E = 4


def _brute_force(indices, weights, factor, policy):
    T, K = indices.shape
    cap = math.ceil(T * K / E * factor)
    pairs = [(t, k) for t in range(T) for k in range(K) if 0 <= indices[t, k] < E]
    kept = set()
    for e in range(E):
        mine = [(t, k) for (t, k) in pairs if indices[t, k] == e]
        if policy == "probs":  # highest weight first, earlier assignment first among equals
            mine.sort(key=lambda tk: (-float(weights[tk]), tk[0] * K + tk[1]))
        kept.update(mine[:cap])
    new_idx = indices.clone()
    new_w = weights.clone()
    for t in range(T):
        for k in range(K):
            if (t, k) not in kept:
                new_idx[t, k], new_w[t, k] = E, 0.0
    return new_idx, new_w


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("factor", [0.5, 1.0, 1.5])
@pytest.mark.parametrize("top_k", [1, 2])
def test_drop_matches_brute_force(policy: str, factor: float, top_k: int) -> None:
    g = torch.Generator().manual_seed(int(factor * 10) + top_k)
    T = 11
    indices = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(T)])
    indices[:6, 0] = 1  # overload one expert
    indices[0, 0] = E  # already dropped stays dropped
    weights = torch.rand(T, top_k, generator=g)
    weights[3, 0] = weights[4, 0]  # a tie: the earlier assignment wins
    got_idx, got_w = drop_over_capacity(indices, weights, E, factor, policy)  # type: ignore[arg-type]
    want_idx, want_w = _brute_force(indices, weights, factor, policy)
    assert torch.equal(got_idx, want_idx)
    assert torch.equal(got_w, want_w)
    kept = got_idx[got_idx < E]
    assert torch.bincount(kept, minlength=E).max() <= expert_capacity(T, top_k, E, factor)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")  # megatron-core's import
@pytest.mark.parametrize("factor", [0.5, 1.0])
def test_probs_policy_matches_megatron_core(factor: float) -> None:
    """megatron-core's ``apply_router_token_dropping`` on the dense [T, E] form keeps the same pairs (no ties)."""
    from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping

    g = torch.Generator().manual_seed(5)
    T, K = 16, 2
    indices = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    indices[:8, 0], indices[:8, 1] = 3, torch.arange(8) % 3  # overload expert 3, keep choices distinct
    weights = torch.rand(T, K, generator=g)
    dense_probs = torch.zeros(T, E).scatter(1, indices, weights)
    dense_map = torch.zeros(T, E, dtype=torch.bool).scatter(1, indices, True)
    _, mc_map = apply_router_token_dropping(dense_probs, dense_map, K, factor, drop_policy="probs")
    ours, _ = drop_over_capacity(indices, weights, E, factor, "probs")
    kept = ours < E
    assert torch.equal(torch.zeros(T, E, dtype=torch.bool).scatter(1, indices, kept), mc_map)
    assert (~kept).any()


def test_policies_differ_on_an_overloaded_expert() -> None:
    indices = torch.zeros(4, 1, dtype=torch.long)  # all four tokens on expert 0; capacity ceil(4/4 * 1) = 1
    weights = torch.tensor([[0.1], [0.9], [0.5], [0.3]])
    by_probs, _ = drop_over_capacity(indices, weights, E, 1.0, "probs")
    by_position, _ = drop_over_capacity(indices, weights, E, 1.0, "position")
    assert by_probs.flatten().tolist() == [E, 0, E, E]
    assert by_position.flatten().tolist() == [0, E, E, E]


def test_dropped_weights_get_no_gradient_and_kept_ones_do() -> None:
    indices = torch.zeros(4, 1, dtype=torch.long)
    weights = torch.tensor([[0.1], [0.9], [0.5], [0.3]], requires_grad=True)
    _, new_w = drop_over_capacity(indices, weights, E, 1.0, "probs")
    new_w.sum().backward()
    assert weights.grad.flatten().tolist() == [0.0, 1.0, 0.0, 0.0]


def test_layer_with_capacity_equals_layer_on_dropped_routing() -> None:
    """Dropped assignments contribute zero: the layer equals experts(x, dropped routing) + shared experts."""
    torch.manual_seed(0)
    layer = MoELayer(
        8, 4, E, 2, shared_expert_ffn_hidden_size=4, capacity_factor=0.5, token_drop_policy="position"
    ).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    _, w, idx = layer.gate(x.view(-1, 8))
    d_idx, d_w = drop_over_capacity(idx, w, E, 0.5, "position")
    assert (d_idx == E).any()
    want = layer.experts.forward_loop(x.view(-1, 8), d_idx, d_w) + layer.shared_experts(x.view(-1, 8))
    torch.testing.assert_close(layer(x), want.view(2, 5, 8))


@pytest.mark.parametrize(
    ("factor", "policy", "match"),
    [
        (0.0, "probs", r"capacity_factor=0.0 must be None \(dropless\) or a positive number"),
        (-1, "probs", r"capacity_factor=-1 must be None"),
        (True, "probs", r"capacity_factor=True must be None"),
        (1.0, "random", r"token_drop_policy='random' is not one of \['probs', 'position'\]"),
    ],
)
def test_capacity_validation(factor, policy, match) -> None:
    with pytest.raises(ValueError, match=match):
        drop_over_capacity(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1), E, factor, policy)
    with pytest.raises(ValueError, match=match):
        MoELayer(8, 4, E, 1, capacity_factor=factor, token_drop_policy=policy)
