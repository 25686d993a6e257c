"""The per-token sums of ``moe/permute.py`` and ``moe/dispatch/dedup.py`` (the combine, and the backward of the
gathers) against a plain float64 loop that adds each entry into its row in list order, and without any
accumulating scatter (``index_add``, ``index_put`` with accumulate, ``scatter_add``) on floating-point rows: on CUDA
those run with atomics, whose order changes from run to run."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_moe_overlap.moe.dispatch.dedup import sum_per_token, token_rows
from lightning_moe_overlap.moe import permute as permute_module
from lightning_moe_overlap.moe.permute import appearance_slots, gather_rows, scatter_weighted

ACCUMULATING = ("index_add", "index_put", "scatter_add", "scatter_reduce", "_index_put_impl", "put")


class AccumulatingScatters(TorchDispatchMode):
    """Records the accumulating scatter ops that run on floating-point tensors (integer counts are exact)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__.rstrip("_")
        accumulate = True
        if name in ("index_put", "_index_put_impl"):  # (self, indices, values, accumulate=False, ...)
            accumulate = bool(kwargs.get("accumulate", args[3] if len(args) > 3 else False))
        if name in ACCUMULATING and accumulate and args[0].is_floating_point():
            self.seen.append(name)
        return func(*args, **kwargs)


@pytest.fixture(autouse=True, params=["slots", "index_add"])
def sum_path(request, monkeypatch):  # noqa: ANN001, ANN201
    """Every test runs through the slot sums that CUDA uses (forced here on CPU) and through CPU's ordered
    ``index_add_``: both must give the loop's values."""
    if request.param == "slots":
        monkeypatch.setattr(permute_module, "index_add_is_ordered", lambda device: False)
    return request.param


def _loop_scatter(y_AD, assign_A, weights_TK, num_tokens):
    """``out[t] += y[a] * w[a]`` for each assignment ``a`` of token ``t``, one at a time, in list order (float64)."""
    top_k = weights_TK.shape[-1]
    out = torch.zeros(num_tokens, y_AD.shape[-1], dtype=torch.float64)
    for a, assignment in enumerate(assign_A.tolist()):
        t, k = divmod(assignment, top_k)
        out[t] += y_AD[a].double() * weights_TK[t, k].double()
    return out


def _loop_sum(src_AD, row_A, num_rows):
    out = torch.zeros(num_rows, src_AD.shape[-1], dtype=torch.float64)
    for a, row in enumerate(row_A.tolist()):
        out[row] += src_AD[a].double()
    return out


def _assignments(num_tokens: int, top_k: int, kept: int, seed: int) -> torch.Tensor:
    """``kept`` distinct assignment ids in a random order (every token with 0 to K of them)."""
    return torch.randperm(num_tokens * top_k, generator=torch.Generator().manual_seed(seed))[:kept]


@pytest.mark.parametrize("top_k", [1, 3, 8])
@pytest.mark.parametrize("fraction", [1.0, 0.6, 0.0])
def test_scatter_weighted_and_its_backward_equal_the_float64_loop(top_k, fraction):
    num_tokens, dim = 9, 5
    assign_A = _assignments(num_tokens, top_k, int(num_tokens * top_k * fraction), seed=top_k)
    g = torch.Generator().manual_seed(1)
    y = torch.randn(assign_A.numel(), dim, generator=g, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(num_tokens, top_k, generator=g, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(num_tokens, dim, generator=g, dtype=torch.float64)
    with AccumulatingScatters() as mode:
        out = scatter_weighted(y, assign_A, weights, num_tokens, torch.float64)
        out.backward(upstream)
    assert mode.seen == [] or permute_module.index_add_is_ordered(torch.device("cpu"))  # the slots: no atomics
    assert torch.equal(out, _loop_scatter(y.detach(), assign_A, weights.detach(), num_tokens))  # same order: bitwise
    tokens, choices = assign_A // top_k, assign_A % top_k
    assert torch.equal(y.grad, upstream[tokens] * weights.detach()[tokens, choices].unsqueeze(-1))
    want_w = torch.zeros(num_tokens, top_k, dtype=torch.float64)
    want_w[tokens, choices] = (upstream[tokens] * y.detach()).sum(-1)
    assert torch.equal(weights.grad, want_w)


@pytest.mark.parametrize("top_k", [2, 8])
def test_gather_rows_backward_equals_the_float64_loop(top_k):
    num_tokens, dim = 11, 4
    assign_A = _assignments(num_tokens, top_k, num_tokens * top_k - 5, seed=7)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(num_tokens, dim, generator=g, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(assign_A.numel(), dim, generator=g, dtype=torch.float64)
    with AccumulatingScatters() as mode:
        rows = gather_rows(x, assign_A, top_k)
        rows.backward(upstream)
    assert mode.seen == [] or permute_module.index_add_is_ordered(torch.device("cpu"))  # the slots: no atomics
    assert torch.equal(rows, x.detach()[assign_A // top_k])
    assert torch.equal(x.grad, _loop_sum(upstream, assign_A // top_k, num_tokens))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_sums_add_in_list_order_like_index_add_on_cpu(dtype):
    """The additions are index_add_'s on CPU (one entry at a time, in list order; 16-bit rows in float32): the
    same bits, forward and backward."""
    num_tokens, top_k, dim = 13, 8, 16
    assign_A = _assignments(num_tokens, top_k, 90, seed=3)
    g = torch.Generator().manual_seed(4)
    y = torch.randn(assign_A.numel(), dim, generator=g).to(dtype)
    weights = torch.rand(num_tokens, top_k, generator=g)
    out = scatter_weighted(y, assign_A, weights, num_tokens, dtype)
    w_A = weights.reshape(-1)[assign_A]
    want = torch.zeros(num_tokens, dim, dtype=dtype).index_add_(0, assign_A // top_k, (y * w_A[:, None]).to(dtype))
    assert torch.equal(out, want)
    torch.testing.assert_close(out.double(), _loop_scatter(y, assign_A, weights, num_tokens), rtol=2e-2, atol=2e-2)
    x, x_ref = (torch.randn(num_tokens, dim, generator=g).to(dtype).requires_grad_() for _ in range(2))
    x_ref.data.copy_(x.data)
    upstream = torch.randn(assign_A.numel(), dim, generator=g).to(dtype)
    gather_rows(x, assign_A, top_k).backward(upstream)
    x_ref.index_select(0, assign_A // top_k).backward(upstream)
    assert torch.equal(x.grad, x_ref.grad)


def test_dedup_token_rows_and_sum_per_token_equal_the_float64_loop():
    num_tokens, ep_size, dim = 6, 3, 4
    g = torch.Generator().manual_seed(5)
    present = torch.rand(ep_size, num_tokens, generator=g) < 0.7  # (destination, token) pairs that carry a row
    token_U = torch.arange(num_tokens).repeat(ep_size)[present.reshape(-1)]  # by destination, then token
    x = torch.randn(num_tokens, dim, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(token_U.numel(), dim, generator=g, dtype=torch.float64, requires_grad=True)
    upstream_U, upstream_T = torch.randn(token_U.numel(), dim, generator=g, dtype=torch.float64), torch.randn(
        num_tokens, dim, generator=g, dtype=torch.float64
    )
    with AccumulatingScatters() as mode:
        rows = token_rows(x, token_U, ep_size)
        out = sum_per_token(y, token_U, num_tokens, ep_size)
        (rows * upstream_U).sum().add((out * upstream_T).sum()).backward()
    assert mode.seen == [] or permute_module.index_add_is_ordered(torch.device("cpu"))  # the slots: no atomics
    assert torch.equal(rows, x.detach()[token_U])
    assert torch.equal(out, _loop_sum(y.detach(), token_U, num_tokens))
    assert torch.equal(x.grad, _loop_sum(upstream_U, token_U, num_tokens))
    assert torch.equal(y.grad, upstream_T[token_U])


def test_appearance_slots_rank_each_entry_within_its_row():
    row_A = torch.tensor([2, 0, 2, 2, 1, 0, 2])
    assert appearance_slots(row_A, 4).tolist() == [0, 0, 1, 2, 0, 1, 3]
    assert appearance_slots(torch.zeros(0, dtype=torch.long), 3).tolist() == []


def test_the_dispatch_mode_sees_index_add():
    """The premise of the checks above: an index_add on float rows is recorded."""
    with AccumulatingScatters() as mode:
        torch.zeros(3, 2).index_add_(0, torch.tensor([0, 0]), torch.ones(2, 2))
        torch.zeros(3, dtype=torch.long).scatter_add_(0, torch.tensor([1, 1]), torch.ones(2, dtype=torch.long))
        x = torch.ones(3, 2, requires_grad=True)
        x.index_select(0, torch.tensor([0, 0])).sum().backward()  # index_select's own backward
    assert mode.seen == ["index_add", "index_add"]
