"""Expert GEMMs over rows in segments (the all-to-all's receive layout on CPU) against the same rows sorted by expert.

The oracle: permute the rows to expert-major order, run the sorted kernels, permute back. The products are the
same, but a GEMM's rounding depends on its shape (the BLAS kernel picked for the row count), and an expert's weight
gradient sums its segments one after the other instead of in one GEMM, so they agree within float rounding
(float64 here: 1e-12), not bitwise.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from lightning_moe_overlap.moe import grouped_linear, grouped_mlp
from lightning_moe_overlap.moe.grouped import RowSplits
from lightning_moe_overlap.overlap.runtime import CommRuntime

E, D, F = 3, 10, 6
# (source rank, local expert) segments, source-major as received: empty segments and an expert with no rows
SEGMENT_SIZES = [[2, 0, 3, 1, 4, 0], [0, 0, 5, 0, 0, 2], [1, 1, 1, 1, 1, 1]]


def _segments(sizes: list[int]) -> tuple[list[int], list[int]]:
    experts = [i % E for i in range(len(sizes))]
    return experts, sizes


def _sorting_permutation(experts: list[int], sizes: list[int]) -> Tensor:
    """Row order that sorts the segments' rows by expert, stable (source order inside an expert)."""
    row_expert = torch.repeat_interleave(torch.tensor(experts), torch.tensor(sizes))
    return torch.argsort(row_expert, stable=True)


@pytest.mark.parametrize("sizes", SEGMENT_SIZES, ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("delay_wgrad", [False, True])
def test_segments_match_the_sorted_rows(sizes: list[int], delay_wgrad: bool) -> None:
    experts, sizes = _segments(sizes)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(sizes), D, dtype=torch.float64, generator=g)
    grad_out = torch.randn(sum(sizes), D, dtype=torch.float64, generator=g)
    params = [
        torch.randn(E, 2 * F, D, dtype=torch.float64, generator=g),
        torch.randn(E, D, F, dtype=torch.float64, generator=g),
        torch.randn(E, 2 * F, dtype=torch.float64, generator=g),
        torch.randn(E, D, dtype=torch.float64, generator=g),
    ]
    perm = _sorting_permutation(experts, sizes)
    totals = [sum(n for e, n in zip(experts, sizes) if e == i) for i in range(E)]

    def run(rows: Tensor, splits: RowSplits | list[int]) -> tuple[Tensor, list[Tensor]]:
        x_in = rows.clone().requires_grad_()
        w = [p.clone().requires_grad_() for p in params]
        runtime = CommRuntime(delay_wgrad=delay_wgrad)
        out = grouped_mlp(
            x_in, splits, w[0], w[1], torch.nn.functional.silu, runtime, gate_up_bias=w[2], down_bias=w[3]
        )
        out.backward(grad_out if splits is not totals else grad_out[perm])
        runtime.flush_wgrad()
        return out, [x_in.grad, *(p.grad for p in w)]

    out, grads = run(x, RowSplits.from_segments(experts, sizes, E))
    ref_out, ref_grads = run(x[perm], totals)
    inverse = torch.argsort(perm)
    torch.testing.assert_close(out, ref_out[inverse], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(grads[0], ref_grads[0][inverse], atol=1e-12, rtol=1e-12)
    for got, want in zip(grads[1:], ref_grads[1:]):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    empty = [e for e in range(E) if totals[e] == 0]
    for e in empty:  # an expert without rows gets a zero gradient, not garbage from an uninitialised buffer
        assert torch.equal(grads[1][e], torch.zeros_like(grads[1][e]))


def test_segments_run_the_loop_even_where_the_grouped_kernel_would(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(8, 16)
    w = torch.randn(2, 16, 16, requires_grad=True)
    grouped_linear(x, w, [4, 4]).sum().backward()
    sorted_calls = len(calls)
    grouped_linear(x, w, RowSplits.from_segments([0, 1, 0, 1], [2, 2, 2, 2], 2)).sum().backward()
    assert len(calls) == sorted_calls  # the segments added none
    assert RowSplits.from_segments([0, 1, 0, 1], [2, 2, 2, 2], 2).host_sizes() == (4, 4)


def test_a_kernel_that_needs_sorted_rows_refuses_segments() -> None:
    splits = RowSplits.from_segments([0, 1, 0, 1], [2, 1, 0, 3], 2)
    with pytest.raises(ValueError, match=r"segments of experts \[0, 1, 1\], not sorted by expert.*Pass rows sorted"):
        splits.sorted_rows()
    in_order = RowSplits.from_segments([0, 1, 0, 1], [2, 1, 0, 0], 2)
    assert in_order.sorted_rows() is in_order  # one run per expert, in expert order: sorted after all
    gap = RowSplits.from_segments([0, 1, 2, 0, 1, 2], [2, 0, 3, 0, 0, 0], 3)
    assert gap.sorted_rows().host_sizes() == (2, 0, 3)  # an empty expert between two runs: still sorted


def test_a_mismatched_segment_list_is_refused() -> None:
    with pytest.raises(ValueError, match=r"experts \[0, 1\] and sizes \[2\] with 2 experts; the rule is one expert"):
        RowSplits.from_segments([0, 1], [2], 2)
    with pytest.raises(ValueError, match=r"one expert in \[0, 2\) per segment size"):
        RowSplits.from_segments([0, 2], [2, 1], 2)
