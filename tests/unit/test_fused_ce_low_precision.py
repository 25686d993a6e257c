"""``fused_linear_cross_entropy`` with bf16 / fp16 inputs: its GEMMs run in the inputs' dtype (the regression this
guards: upcasting them to float32 made the loss 18x slower than the unfused one on an H200), its softmax math in
float32, and its loss and gradients stay within a derived bound of an independent float64 reference computed from
the same low-precision values.

The bound (``low_precision_cross_entropy_bounds``, ``tests/helpers/tolerance.py``) starts from each logit's error:
a bf16 GEMM accumulates in float32 and rounds each logit once, so a logit is off by about ``2**-8`` times its
magnitude ``sum_d |h_d w_d| + |b|``; that error goes through the log-sum-exp (1-Lipschitz), the probabilities
(``p * expm1(error)``) and the gradient block's cast to bf16 and its two GEMMs. Nothing in it is fitted to what
this machine produces. Float32 and float64 inputs compute as before (``tests/unit/test_fused_cross_entropy.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_moe_overlap.loss import fused_linear_cross_entropy
from tests.helpers.data import head_inputs
from tests.helpers.tolerance import assert_within, low_precision_cross_entropy_bounds

T, D, V = 45, 16, 101
GEMMS = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default"}


def _inputs(dtype: torch.dtype, *, bias: bool = True, seed: int = 0) -> tuple[Tensor, ...]:
    return head_inputs(dtype, tokens=T, hidden=D, rows=V, bias=bias, seed=seed)


def _float64_reference(h: Tensor, w: Tensor, b: Tensor | None, target: Tensor, reduction: str) -> list[Tensor]:
    """The loss and the gradients of hidden, weight (and bias) in float64 from the same low-precision values."""
    leaves = [t.detach().double().requires_grad_() for t in (h, w, b) if t is not None]
    bias = leaves[2] if b is not None else None
    loss = F.cross_entropy(F.linear(leaves[0], leaves[1], bias), target, ignore_index=-100, reduction=reduction)
    return [loss.detach(), *torch.autograd.grad(loss, leaves)]


class _GemmDtypes(TorchDispatchMode):
    """Records the input dtypes of every GEMM, and the largest float32 tensor any op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.gemms: list[tuple[torch.dtype, ...]] = []
        self.largest_float32 = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if str(func) in GEMMS:
            self.gemms.append(tuple(a.dtype for a in args if isinstance(a, Tensor)))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, Tensor) and t.dtype == torch.float32:
                self.largest_float32 = max(self.largest_float32, t.numel())
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("chunk", "token_chunk"), [(13, None), (7, 4), (3072, None)])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_low_precision_inputs_match_a_float64_reference_within_the_logits_rounding(
    dtype: torch.dtype, chunk: int, token_chunk: int | None, reduction: str, bias: bool
) -> None:
    h, w, b, target = _inputs(dtype, bias=bias)
    got = fused_linear_cross_entropy(h, w, target, bias=b, chunk_size=chunk, token_chunk_size=token_chunk,
                                     reduction=reduction)  # fmt: skip
    assert got.dtype == torch.float32
    got_grads = torch.autograd.grad(got, [t for t in (h, w, b) if t is not None])
    assert all(g.dtype == dtype for g in got_grads)
    want = _float64_reference(h, w, b, target, reduction)
    bounds = low_precision_cross_entropy_bounds(h, w, b, target, reduction=reduction, chunk=chunk,
                                                token_chunk=token_chunk)  # fmt: skip
    assert_within(got, want[0], bounds["loss"], "loss")
    for name, g, o in zip("hwb", got_grads, want[1:]):
        assert_within(g, o, bounds[name], f"grad {name}")


def test_the_bound_is_tighter_than_the_errors_it_must_catch() -> None:
    """The gradients' bounds are a small part of the gradients: a sign error, a lost ``1 / count`` or a gradient of
    the wrong target would exceed them."""
    h, w, b, target = _inputs(torch.bfloat16)
    want = _float64_reference(h, w, b, target, "mean")
    bounds = low_precision_cross_entropy_bounds(h, w, b, target, chunk=13)
    assert bounds["loss"] < 0.05 * want[0].item()
    for name, grad in zip("hwb", want[1:]):
        assert (bounds[name] < 0.5 * grad.abs().max()).all(), name
        assert bounds[name].sum() < 0.2 * grad.abs().sum(), name


@pytest.mark.parametrize(
    ("dtype", "gemm_dtype"),
    [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float32, torch.float32)],
    ids=["bf16", "fp16", "fp32"],
)
def test_the_block_gemms_run_in_the_inputs_dtype(dtype: torch.dtype, gemm_dtype: torch.dtype) -> None:
    """Every GEMM of the forward and the backward takes the inputs' dtype (bf16 inputs: bf16 GEMMs, not float32
    ones), and with bf16 inputs no float32 tensor the size of the weight is made (its gradient is accumulated per
    row block)."""
    h, w, b, target = _inputs(dtype)
    chunk = 13
    with _GemmDtypes() as forward:
        loss = fused_linear_cross_entropy(h, w, target, bias=b, chunk_size=chunk)
    with _GemmDtypes() as backward:
        loss.backward()
    rows, tokens = -(-V // chunk), -(-T // chunk)
    assert len(forward.gemms) == rows * tokens and len(backward.gemms) == 3 * rows * tokens  # logits, dh, dW
    assert {d for gemm in forward.gemms + backward.gemms for d in gemm} == {gemm_dtype}
    if dtype != torch.float32:
        assert forward.largest_float32 <= T * chunk  # a block of logits; nothing of [T, V]
        assert backward.largest_float32 < V * D  # hidden's float32 gradient [T, D] and [chunk, D] row blocks
        assert backward.largest_float32 <= max(T * D, T * chunk, chunk * D)


def test_mixed_inputs_multiply_in_the_promoted_dtype() -> None:
    """bf16 hidden states with a float32 head: float32 GEMMs, the float32 result of before."""
    h, w, b, target = _inputs(torch.float32)
    with _GemmDtypes() as mode:
        fused_linear_cross_entropy(h.detach().bfloat16(), w, target, bias=b, chunk_size=13).backward()
    assert mode.gemms and {d for gemm in mode.gemms for d in gemm} == {torch.float32}
