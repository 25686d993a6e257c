"""The hand-written backward passes of ``moe/permute.py`` against plain autograd on the same ops, bit for bit."""

from __future__ import annotations

import pytest
import torch

from lightning_moe_overlap.moe.permute import chunk_permutation, inverse_permutation, permute_rows, scatter_weighted


def _reference_scatter(y_AD, assign_A, weights_TK, num_tokens, out_dtype):
    """The autograd composition ``scatter_weighted`` replaces."""
    top_k = weights_TK.shape[-1]
    w_A = weights_TK.reshape(-1).index_select(0, assign_A)
    contrib_AD = (y_AD * w_A.unsqueeze(-1)).to(out_dtype)
    out_TD = torch.zeros(num_tokens, y_AD.shape[-1], dtype=out_dtype)
    return out_TD.index_add(0, torch.div(assign_A, top_k, rounding_mode="floor"), contrib_AD)


@pytest.mark.parametrize(
    ("y_dtype", "out_dtype"),
    [(torch.float32, torch.float32), (torch.float64, torch.float64), (torch.bfloat16, torch.bfloat16)],
)
@pytest.mark.parametrize("kept", [12, 7, 0])  # all assignments, some dropped (a token with none), none
def test_scatter_weighted_matches_autograd_bitwise(y_dtype, out_dtype, kept):
    g = torch.Generator().manual_seed(0)
    num_tokens, top_k, dim = 6, 2, 5
    assign_A = torch.randperm(num_tokens * top_k, generator=g)[:kept]
    y = torch.randn(kept, dim, generator=g).to(y_dtype)
    weights = torch.rand(num_tokens, top_k, generator=g)  # float32 routing weights: promoted with bf16 rows
    upstream = torch.randn(num_tokens, dim, generator=g).to(out_dtype)
    results = []
    for fn in (scatter_weighted, _reference_scatter):
        y_leaf, w_leaf = y.clone().requires_grad_(), weights.clone().requires_grad_()
        out = fn(y_leaf, assign_A, w_leaf, num_tokens, out_dtype)
        out.backward(upstream)
        results.append((out, y_leaf.grad, w_leaf.grad))
    for got, want in zip(results[0], results[1], strict=True):
        assert got.dtype == want.dtype
        assert torch.equal(got, want)


def test_scatter_weighted_without_weight_gradient():
    y = torch.randn(4, 3, requires_grad=True)
    out = scatter_weighted(y, torch.tensor([0, 1, 2, 3]), torch.rand(2, 2), 2, torch.float32)
    out.sum().backward()
    assert y.grad is not None and y.grad.shape == (4, 3)


@pytest.mark.parametrize("given_inverse", [False, True])
def test_permute_rows_matches_index_select_bitwise(given_inverse):
    counts_SE = torch.tensor([[2, 0, 3], [1, 4, 0]])
    perm = chunk_permutation(counts_SE, 10)
    x = torch.randn(10, 4, requires_grad=True)
    upstream = torch.randn(10, 4)
    out = permute_rows(x, perm, inverse_permutation(perm) if given_inverse else None)
    out.backward(upstream)
    x_ref = x.detach().clone().requires_grad_()
    ref = x_ref.index_select(0, perm)
    ref.backward(upstream)
    assert torch.equal(out, ref)
    assert torch.equal(x.grad, x_ref.grad)
    # Round trip: the combine side permutes back with the inverse.
    assert torch.equal(permute_rows(out, inverse_permutation(perm), perm), x)
