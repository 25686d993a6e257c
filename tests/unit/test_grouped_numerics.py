"""The experts' GEMMs under autocast (bf16-mixed / 16-mixed), with empty experts and odd group sizes, and their
host syncs.

CUDA's ``torch._grouped_mm`` takes bf16 only, so under bf16-mixed (fp32 weights) the experts ran the per-expert
loop there, whose backward multiplied a bf16 gradient by an fp32 weight. On CPU the same crash is reproduced by
forcing the loop under ``torch.autocast("cpu", ...)``; these tests run both kernels that way, with and without
delayed weight gradients. 16-mixed runs as ``torch.autocast("cpu", torch.float16)`` (CPU supports fp16 autocast
and fp16 ``_grouped_mm``), so the same code path is checked for both dtypes.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from lightning_moe_overlap.moe import grouped_linear, grouped_mlp
from lightning_moe_overlap.moe.experts import routed_experts_forward
from lightning_moe_overlap.overlap.runtime import CommRuntime
from tests.helpers.syncs import SyncCounter

E, D, F = 4, 16, 8
AMP_DTYPES = [torch.bfloat16, torch.float16]
AMP_TOL = {torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}, torch.float16: {"atol": 4e-3, "rtol": 4e-3}}


def _count_grouped_mm(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _weights(seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(E, 2 * F, D, generator=g) * 0.3).requires_grad_()
    w2 = (torch.randn(E, D, F, generator=g) * 0.3).requires_grad_()
    return w1, w2


def _reference(x: Tensor, counts: list[int], w1: Tensor, w2: Tensor, dtype: torch.dtype) -> Tensor:
    """float32 per-expert MLP on inputs rounded to ``dtype`` (what the autocast GEMMs read)."""
    x, w1, w2 = (t.to(dtype).float() for t in (x, w1, w2))
    outs = []
    for x_e, a, b in zip(x.split(counts), w1, w2):
        gate, up = (x_e @ a.T).chunk(2, dim=-1)
        outs.append((torch.nn.functional.silu(gate) * up) @ b.T)
    return torch.cat(outs)


@pytest.mark.parametrize("amp_dtype", AMP_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("impl", ["loop", "grouped_mm"])
def test_experts_backward_under_autocast(amp_dtype: torch.dtype, impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward under autocast, backward outside it (as Lightning runs them), inline and delayed wgrad."""
    calls = _count_grouped_mm(monkeypatch)
    counts = [3, 0, 5, 2]
    x0 = torch.randn(sum(counts), D, generator=torch.Generator().manual_seed(1))
    results = []
    for delay in (False, True):
        w1, w2 = _weights()
        x = x0.clone().requires_grad_()
        runtime = CommRuntime(delay_wgrad=delay)
        with torch.autocast("cpu", dtype=amp_dtype):
            y = grouped_mlp(x, counts, w1, w2, torch.nn.functional.silu, runtime, impl=impl)  # type: ignore[arg-type]
        assert y.dtype == amp_dtype  # the GEMMs ran in the autocast dtype
        y.float().square().sum().backward()
        assert runtime.pending_wgrad == (2 if delay else 0)
        runtime.flush_wgrad()
        for t in (x, w1, w2):  # gradients come back in each leaf's own dtype
            assert t.grad is not None and t.grad.dtype == torch.float32
        results.append((y.detach(), x.grad, w1.grad, w2.grad))
    for inline, delayed in zip(*results):
        assert torch.equal(inline, delayed)  # delaying the wgrad changes nothing, bit for bit
    torch.testing.assert_close(results[0][0].float(), _reference(x0, counts, w1, w2, amp_dtype), **AMP_TOL[amp_dtype])
    assert results[0][2][1].abs().sum() == 0  # the expert with no rows gets a zero gradient
    assert len(calls) == (12 if impl == "grouped_mm" else 0)  # 6 grouped GEMMs per run, twice


@pytest.mark.parametrize("amp_dtype", AMP_DTYPES, ids=["bf16", "fp16"])
def test_loop_and_grouped_agree_under_autocast(amp_dtype: torch.dtype) -> None:
    counts = [7, 0, 1, 5]
    x0 = torch.randn(sum(counts), D, generator=torch.Generator().manual_seed(2))
    grads = []
    for impl in ("loop", "grouped_mm"):
        w1, w2 = _weights(3)
        x = x0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=amp_dtype):
            y = grouped_mlp(x, counts, w1, w2, torch.nn.functional.silu, impl=impl)  # type: ignore[arg-type]
        y.float().sum().backward()
        grads.append((y.float().detach(), x.grad, w1.grad, w2.grad))
    for loop, grouped in zip(*grads):
        torch.testing.assert_close(grouped, loop, **AMP_TOL[amp_dtype])


def test_autocast_leaves_float64_alone() -> None:
    """Autocast casts only float32/16 inputs (as ``F.linear``): float64 experts keep their dtype."""
    w1, w2 = (w.detach().double().requires_grad_() for w in _weights())
    x = torch.randn(4, D, dtype=torch.float64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = grouped_mlp(x, [1, 1, 1, 1], w1, w2, torch.nn.functional.silu)
    assert y.dtype == torch.float64
    y.sum().backward()
    assert w1.grad is not None and w1.grad.dtype == torch.float64


def test_backward_is_independent_of_the_autocast_state_it_runs_under() -> None:
    """The overlapped schedule may run a backward under the caller's autocast; the result must not change."""
    counts = [2, 3, 0, 4]
    x0 = torch.randn(sum(counts), D, generator=torch.Generator().manual_seed(4))
    grads = []
    for backward_autocast in (False, True):
        w1, w2 = _weights()
        x = x0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = grouped_mlp(x, counts, w1, w2, torch.nn.functional.silu)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=backward_autocast):
            torch.autograd.backward(y, torch.ones_like(y))
        grads.append((x.grad, w1.grad, w2.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


# -- empty experts and odd group sizes (defect 9) ------------------------------------------------------------
SPLITS = [
    [0, 5, 0, 3, 7, 0],  # empty experts first, in the middle and last; no size a multiple of 8
    [13, 0, 0, 0, 0, 0],  # every row to one expert
    [0, 0, 0, 0, 0, 9],
    [1, 1, 1, 1, 1, 1],
    [3, 11, 17, 5, 9, 2],
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", SPLITS, ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_mm_matches_loop_with_empty_and_odd_groups(
    dtype: torch.dtype, splits: list[int], transposed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forward, dgrad and wgrad of the grouped kernel against the per-expert loop, expert by expert."""
    calls = _count_grouped_mm(monkeypatch)
    g = torch.Generator().manual_seed(sum(splits))
    e, i, o = len(splits), 16, 24
    x0 = torch.randn(sum(splits), i, generator=g).to(dtype)
    w0 = torch.randn(*((e, i, o) if transposed else (e, o, i)), generator=g).to(dtype)
    upstream = torch.randn(sum(splits), o, generator=g).to(dtype)
    results = []
    for impl in ("loop", "grouped_mm"):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = grouped_linear(x, w, splits, transposed=transposed, impl=impl)  # type: ignore[arg-type]
        y.backward(upstream)
        results.append((y.detach(), x.grad, w.grad))
    assert len(calls) == 3  # the grouped run used the kernel for forward, dgrad and wgrad
    tol = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1.6e-2}
    for loop, grouped in zip(*results):
        torch.testing.assert_close(grouped, loop, **tol)
    for expert, size in enumerate(splits):
        if size == 0:  # exact zeros, not stale memory
            assert torch.count_nonzero(results[1][2][expert]) == 0


@pytest.mark.parametrize("splits", SPLITS[:2], ids=lambda s: "-".join(map(str, s)))
def test_device_counts_give_the_same_bits_as_a_host_list(splits: list[int]) -> None:
    g = torch.Generator().manual_seed(5)
    x0, w0 = torch.randn(sum(splits), 16, generator=g), torch.randn(len(splits), 8, 16, generator=g)
    results = []
    for counts in (splits, torch.tensor(splits)):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = grouped_linear(x, w, counts)
        y.square().sum().backward()
        results.append((y, x.grad, w.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


# -- host syncs (defect 5, the experts' part) ----------------------------------------------------------------
def test_grouped_path_has_no_host_sync() -> None:
    """One grouped-experts forward + backward from device counts: no sync-causing call at all (documented: 0)."""
    w1, w2 = _weights()
    counts = torch.tensor([3, 0, 5, 2])
    b1, b2 = torch.randn(E, 2 * F, requires_grad=True), torch.randn(E, D, requires_grad=True)
    x = torch.randn(10, D, requires_grad=True)
    runtime = CommRuntime(delay_wgrad=True)
    with SyncCounter() as syncs:
        y = grouped_mlp(x, counts, w1, w2, torch.nn.functional.silu, runtime, gate_up_bias=b1, down_bias=b2)
        y.sum().backward()
        runtime.flush_wgrad()
    assert syncs.total == 0, dict(syncs.counts)
    assert w1.grad is not None and b1.grad is not None


def test_host_list_costs_one_offsets_copy_per_call() -> None:
    """From a host list the offsets are built once per call (they were built per GEMM: six times)."""
    w1, w2 = _weights()
    x = torch.randn(10, D, requires_grad=True)
    with SyncCounter() as syncs:
        grouped_mlp(x, [3, 0, 5, 2], w1, w2, torch.nn.functional.silu).sum().backward()
    assert dict(syncs.counts) == {"to(device)": 1}  # the one non_blocking copy of the offsets


def test_loop_path_syncs_are_the_documented_ones() -> None:
    """The reference loop reads device counts back once per call (marked ``NOTE: D2H sync``)."""
    w1, w2 = _weights()
    x, counts = torch.randn(10, D, requires_grad=True), torch.tensor([3, 0, 5, 2])
    with SyncCounter() as syncs:
        y = grouped_mlp(x, counts, w1, w2, torch.nn.functional.silu, impl="loop")
        y.sum().backward()
    assert dict(syncs.counts) == {"tolist": 1}


def test_single_process_experts_sync_once_for_the_kept_rows() -> None:
    """``Experts`` (no ep wrapper) syncs once for the number of kept rows; the GEMMs add none.

    The counting of the assignments (``bincount`` in ``sort_by_expert``) is the router/permute side's, counted
    separately here so this test pins only the experts' own syncs.
    """
    w1, w2 = _weights()
    x = torch.randn(6, D, requires_grad=True)
    idx = torch.tensor([[0, 2], [2, 3], [0, 3], [2, 0], [3, 2], [0, 4]])  # 4 == E: a dropped choice
    weights = torch.rand(6, 2)
    with SyncCounter() as syncs:
        routed_experts_forward(x, idx, weights, w1, w2, torch.nn.functional.silu).sum().backward()
    syncs.counts.pop("aten.bincount", None)  # the reference routing's count, not the experts'
    assert dict(syncs.counts) == {"int": 1}
