"""``fused_linear_cross_entropy`` against the oracle ``F.cross_entropy`` of the full logits, computed in one process:
the loss and the gradients of hidden, weight and bias, for block sizes that divide the shapes and ones that do not,
ignored tokens, both reductions, leading dimensions and autocast; what it keeps for backward; its input errors.
bf16 / fp16 inputs (whose GEMMs run in their own dtype): ``tests/unit/test_fused_ce_low_precision.py``.

Tolerances: derived from float32 arithmetic, not fitted to one machine's kernels: the fused loss and the oracle
compute the same sums in different orders (logits block by block, an online softmax, gradients accumulated over
blocks), and ATen's kernels order them differently per CPU (``ATEN_CPU_CAPABILITY``). ``cross_entropy_bounds``
(``tests/helpers/tolerance.py``) gives, per quantity, the bound of that chain of reordered sums: the loss relative to
the sum of its positive per-token terms plus each token's log-sum-exp bound, each gradient entry relative to the sum
of the absolute values of its terms (``|softmax - onehot| <= softmax + onehot`` times the other factor).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_moe_overlap.loss import fused_linear_cross_entropy
from tests.helpers.data import head_inputs
from tests.helpers.tolerance import assert_within, blocks_of, cross_entropy_bounds, unit_roundoff

T, D, V = 45, 16, 101  # 45 tokens, 101 rows: prime-ish, so most block sizes leave a short last block


def _inputs(dtype: torch.dtype = torch.float32, *, bias: bool = True, seed: int = 0) -> tuple[Tensor, ...]:
    return head_inputs(dtype, tokens=T, hidden=D, rows=V, bias=bias, seed=seed)


def _oracle(h: Tensor, w: Tensor, b: Tensor | None, target: Tensor, reduction: str = "mean") -> Tensor:
    logits = F.linear(h.float(), w.float(), None if b is None else b.float())
    return F.cross_entropy(logits, target, ignore_index=-100, reduction=reduction)


def _grads(loss: Tensor, *tensors: Tensor | None) -> list[Tensor]:
    present = [t for t in tensors if t is not None]
    return list(torch.autograd.grad(loss, present))


def _loss_close(got: Tensor, want: Tensor, bounds: dict) -> None:
    rtol, atol = bounds["loss"]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def _grads_close(
    got: list[Tensor], want: list[Tensor], bounds: dict, names: str, low: torch.dtype | None = None
) -> None:
    """Each gradient (``names``: which of ``"hwb"`` they are) within its bound; ``low``: both come back rounded to
    that dtype from float32 values ``x`` within the bound of each other (the fused one's cast, and the oracle's
    ``.float()`` casting its gradient back): ``u * |x|`` more each, ``|x| <= |want| / (1 - u)`` for the oracle's and
    that plus the bound for the fused one's."""
    assert len(got) == len(want) == len(names)
    for g, o, name in zip(got, want, names, strict=True):
        bound = bounds[name]
        if low is not None:
            u = unit_roundoff(low)
            bound = bound + u * (2 * o.float().abs() / (1 - u) + bound)
        assert_within(g, o, bound, f"grad {name}")


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 45, 64, 3072])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_float32_matches_full_logits(chunk_size: int, reduction: str) -> None:
    h, w, b, target = _inputs()
    want = _oracle(h, w, b, target, reduction)
    got = fused_linear_cross_entropy(h, w, target, bias=b, chunk_size=chunk_size, reduction=reduction)
    assert got.dtype == torch.float32
    bounds = cross_entropy_bounds(h, w, b, target, reduction=reduction, blocks=blocks_of(V, chunk_size))
    _loss_close(got, want, bounds)
    _grads_close(_grads(got, h, w, b), _grads(want, h, w, b), bounds, "hwb")


@pytest.mark.parametrize(("chunk_size", "token_chunk_size"), [(7, 45), (64, 4), (3, 100)])
def test_token_and_vocab_blocks_of_different_sizes(chunk_size: int, token_chunk_size: int) -> None:
    h, w, _, target = _inputs(bias=False)
    want = _oracle(h, w, None, target)
    got = fused_linear_cross_entropy(h, w, target, chunk_size=chunk_size, token_chunk_size=token_chunk_size)
    bounds = cross_entropy_bounds(h, w, None, target, blocks=blocks_of(V, chunk_size))
    _loss_close(got, want, bounds)
    _grads_close(_grads(got, h, w), _grads(want, h, w), bounds, "hw")


def test_leading_dimensions_are_flattened() -> None:
    h, w, b, target = _inputs()
    h3, target3 = h.reshape(5, 9, D), target.reshape(5, 9)
    got = fused_linear_cross_entropy(h3, w, target3, bias=b, chunk_size=8)
    want = _oracle(h, w, b, target)
    bounds = cross_entropy_bounds(h, w, b, target, blocks=blocks_of(V, 8))
    _loss_close(got, want, bounds)
    _grads_close(torch.autograd.grad(got, h), torch.autograd.grad(want, h), bounds, "h")


def test_ignored_tokens_get_no_gradient_and_all_ignored_is_nan_like_the_oracle() -> None:
    h, w, b, target = _inputs()
    loss = fused_linear_cross_entropy(h, w, target, bias=b, chunk_size=10)
    (grad_h,) = torch.autograd.grad(loss, h)
    assert torch.equal(grad_h[target == -100], torch.zeros_like(grad_h[target == -100]))
    assert grad_h[target != -100].abs().amax(dim=1).min() > 0
    none = torch.full_like(target, -100)
    assert torch.isnan(_oracle(h, w, b, none)) and torch.isnan(fused_linear_cross_entropy(h, w, none, bias=b))
    assert fused_linear_cross_entropy(h, w, none, bias=b, reduction="sum").item() == 0.0


def test_custom_ignore_index_and_int32_targets() -> None:
    h, w, b, target = _inputs()
    target = torch.where(target == -100, torch.tensor(7), target)
    want = F.cross_entropy(F.linear(h, w, b), target, ignore_index=7)
    got = fused_linear_cross_entropy(h, w, target.int(), bias=b, ignore_index=7, chunk_size=9)
    _loss_close(got, want, cross_entropy_bounds(h, w, b, target, blocks=blocks_of(V, 9), ignore_index=7))


def test_autocast_does_not_lower_the_blocks() -> None:
    h, w, b, target = _inputs()
    want = _oracle(h, w, b, target)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fused_linear_cross_entropy(h, w, target, bias=b, chunk_size=16)
    bounds = cross_entropy_bounds(h, w, b, target, blocks=blocks_of(V, 16))
    _loss_close(got, want, bounds)
    _grads_close(torch.autograd.grad(got, w), torch.autograd.grad(want, w), bounds, "w")


def test_only_inputs_and_per_token_vectors_are_kept_for_backward() -> None:
    h, w, b, target = _inputs()
    saved: list[Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = fused_linear_cross_entropy(h, w, target, bias=b, chunk_size=8)
    assert saved and max(t.numel() for t in saved) == V * D  # the weight itself; nothing of [T, V]
    assert sorted(t.numel() for t in saved if t.numel() not in (V * D, T * D, V)) == [1, T, T, T]
    loss.backward()


def test_no_grad_forward_and_frozen_weight() -> None:
    h, w, b, target = _inputs()
    with torch.no_grad():
        got = fused_linear_cross_entropy(h, w, target, bias=b)
        _loss_close(got, _oracle(h, w, b, target), cross_entropy_bounds(h, w, b, target))
    frozen = w.detach()
    loss = fused_linear_cross_entropy(h, frozen, target, chunk_size=5)
    bounds = cross_entropy_bounds(h, frozen, None, target, blocks=blocks_of(V, 5))
    _grads_close(torch.autograd.grad(loss, h), torch.autograd.grad(_oracle(h, frozen, None, target), h), bounds, "h")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(reduction="none"), ValueError, r"reduction='none'\. Rule: 'mean' or 'sum'"),
        (dict(chunk_size=0), ValueError, r"chunk_size=0\. Rule: an integer >= 1"),
        (dict(chunk_size=True), ValueError, r"chunk_size=True\. Rule: an integer >= 1"),
        (dict(token_chunk_size=-3), ValueError, r"token_chunk_size=-3\. Rule: an integer >= 1"),
        (dict(weight=torch.zeros(V, D + 1)), ValueError, r"weight \[101, 17\]\. Rule: weight is \[V, D\]"),
        (dict(target=torch.zeros(T - 1, dtype=torch.long)), ValueError, r"target \[44\] for hidden \[45, 16\]"),
        (dict(target=torch.zeros(T)), TypeError, r"target has dtype torch\.float32\. Rule: class ids"),
        (dict(bias=torch.zeros(V - 1)), ValueError, r"bias \[100\] for weight \[101, 16\]\. Rule: one bias per"),
    ],
    ids=["reduction", "chunk0", "chunk-bool", "token-chunk", "width", "target-shape", "target-dtype", "bias"],
)
def test_input_errors_name_values_rule_and_fix(kwargs: dict, error: type, match: str) -> None:
    h, w, b, target = _inputs()
    args = dict(weight=w, target=target, bias=b)
    args.update({k: v for k, v in kwargs.items() if k in args})
    options = {k: v for k, v in kwargs.items() if k not in args}
    with pytest.raises(error, match=match + r".*Fix: "):
        fused_linear_cross_entropy(h, args["weight"], args["target"], bias=args["bias"], **options)
