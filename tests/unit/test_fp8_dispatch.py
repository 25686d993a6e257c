"""FP8 dispatch in one process: the all-to-all dispatcher's rows in e4m3 with a scale per row, read as they are by the
experts' FP8 kernel; the backward in high precision; the bytes on the wire; FP8 saved activations offloaded as FP8.
The deduplicated path (``dedup=True``: each token once per destination rank) sends its unique rows in FP8 too.

The exchange is real: a loopback communicator (``moe/dispatch/loopback.py``) copies every all-to-all as another
rank would, and a recording observer sees each collective's bytes. Oracles: the same experts on high-precision
rows (``fp8_dispatch=False``): with ``rowwise`` the first GEMM quantises each row exactly as the dispatch does, so
the forward and the input gradient are bitwise equal; float32 experts (SQNR) for ``tensorwise``; the byte counts
from the shapes (``D`` FP8 bytes and a 4-byte scale per row, ``2 D`` in bf16, ``4 D`` in float32); for the
deduplicated path, also the plain path's FP8 dispatch (the same rows in the same order) and its high-precision
dispatch, and the unique rows counted from the routing (one per token here: one process, one destination).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_moe_overlap.callbacks import OffloadEngine, _forward_regions
from lightning_moe_overlap.fp8 import apply_fp8
from lightning_moe_overlap.fp8.experts_kernel import Float8GroupedLinear
from lightning_moe_overlap.float8.recipes import RECIPES
from lightning_moe_overlap.float8.rows import Float8Rows, pack_rows, quantize_rows, unpack_rows
from lightning_moe_overlap.moe import Experts, apply_expert_parallel
from lightning_moe_overlap.moe.dispatch.float8 import float8_all_to_all, float8_all_to_all_many, gather_float8_rows
from lightning_moe_overlap.moe.dispatch.loopback import Loopback
from lightning_moe_overlap.moe.grouped import RowSplits
from lightning_moe_overlap.overlap.runtime import CommRuntime
from tests.helpers.traffic import Recording

E, F, T, K = 4, 32, 24, 2


class Holder(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.experts = Experts(E, hidden, F)


def _run(
    recipe: str | None, fp8_dispatch: bool, *, hidden: int = 32, dtype=torch.float32, all_to_one=False, dedup=False
):
    """``(out, x.grad, gate_up grad, per-collective bytes, rows sent, weights.grad)`` of one forward and backward."""
    torch.manual_seed(0)
    model = Holder(hidden).to(dtype)
    x = torch.randn(T, hidden, dtype=dtype, requires_grad=True)
    indices = torch.zeros(T, K, dtype=torch.long) if all_to_one else torch.randint(0, E, (T, K))
    if all_to_one:
        indices[:, 1] = 1  # experts 2 and 3 get no rows
    weights = torch.rand(T, K, dtype=dtype, requires_grad=True)
    traffic = Recording()
    runtime = CommRuntime(communicator=Loopback(0.0))
    runtime.attach(traffic)
    (ep,) = apply_expert_parallel(model, None, runtime=runtime, dedup=dedup)
    if recipe is not None:
        apply_fp8(model, recipe, dense=False)
    ep.fp8_dispatch = fp8_dispatch
    out = model.experts(x, indices, weights)
    out.float().pow(2).sum().backward()
    return out.detach(), x.grad, ep.gate_up_proj.grad, traffic.each, T * K, weights.grad


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return (20 * torch.log10(ref.norm() / (ref - out).norm())).item()


@pytest.mark.parametrize("all_to_one", [False, True], ids=["random", "two-experts-empty"])
def test_rowwise_fp8_dispatch_is_bitwise_the_high_precision_rows(all_to_one: bool) -> None:
    out, dx, *_ = _run("rowwise", True, all_to_one=all_to_one)
    ref_out, ref_dx, *_ = _run("rowwise", False, all_to_one=all_to_one)
    assert torch.equal(out, ref_out) and torch.equal(dx, ref_dx)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_dispatch_stays_close_to_float32_experts(recipe: str) -> None:
    out, dx, dw, *_ = _run(recipe, True)
    ref_out, ref_dx, ref_dw, *_ = _run(None, False)
    assert _sqnr(ref_out, out) >= 18 and _sqnr(ref_dx, dx) >= 18 and _sqnr(ref_dw, dw) >= 18


@pytest.mark.parametrize("hidden", [32, 256])
def test_dispatch_bytes_per_row_fp8_against_bf16_and_float32(hidden: int) -> None:
    """Collectives per call: counts, tokens, combine (forward); combine, tokens (backward)."""
    bf16 = _run(None, False, hidden=hidden, dtype=torch.bfloat16)
    fp32 = _run(None, False, hidden=hidden)
    fp8 = _run("rowwise", True, hidden=hidden, dtype=torch.bfloat16)
    rows = fp8[4]
    per_row = {name: run[3][1] / rows for name, run in (("fp8", fp8), ("bf16", bf16), ("fp32", fp32))}
    assert per_row == {"fp8": hidden + 4, "bf16": 2 * hidden, "fp32": 4 * hidden}
    assert per_row["fp8"] / per_row["bf16"] <= 0.57  # about half, the scales included
    # the combine and both backward exchanges stay in high precision: the same bytes as without FP8 dispatch
    assert fp8[3][2:] == bf16[3][2:] == [2 * hidden * rows] * 3


def test_fp8_dispatch_off_or_high_precision_experts_send_high_precision_rows() -> None:
    for recipe, on in ((None, True), ("rowwise", False)):
        assert _run(recipe, on)[3][1] == 4 * 32 * T * K


def test_float8_all_to_all_regroups_rows_and_its_backward_undoes_it() -> None:
    """The regrouping path (CUDA with ep > 1) on one process: oracle ``index_select`` of the quantised rows, and
    its autograd for the gradient."""
    recipe = RECIPES["tensorwise"]
    x = torch.randn(6, 16, requires_grad=True)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    rows = float8_all_to_all(x, recipe, (6,), (6,), None, None, perm)
    q, scale = quantize_rows(x.detach(), recipe)
    assert isinstance(rows, Float8Rows) and rows.dtype == torch.float32 and rows.data_fp8.dtype == torch.float8_e4m3fn
    assert torch.equal(rows.data_fp8.view(torch.uint8), q[perm].view(torch.uint8)) and torch.equal(rows.scale, scale[perm])
    g = torch.randn(6, 16)
    (x_grad,) = torch.autograd.grad(rows, x, g)
    oracle = x.detach().clone().requires_grad_()
    oracle.index_select(0, perm).backward(g)
    assert x_grad.dtype == torch.float32 and torch.equal(x_grad, oracle.grad)


def test_wire_format_round_trips_and_other_ops_see_the_dequantised_rows() -> None:
    x = torch.randn(5, 32) * torch.logspace(-3, 3, 5).unsqueeze(1)
    q, scale = quantize_rows(x, RECIPES["rowwise"])
    packed = pack_rows(q, scale)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 36)
    q2, scale2 = unpack_rows(packed, torch.float8_e4m3fn)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale2, scale)
    rows = Float8Rows(q2, scale2, torch.bfloat16)
    expected = (q.float() * scale).to(torch.bfloat16)
    assert type(rows + 0) is torch.Tensor and torch.equal(rows + 0, expected)
    assert type(rows.detach()) is Float8Rows
    assert _sqnr(x, (rows + 0).float()) > 25  # e4m3 with a scale per row follows rows 10^6 apart


def test_offload_moves_the_fp8_rows_saved_by_the_fp8_gemm_as_fp8() -> None:
    """The FP8 kernel saves the dispatched rows as e4m3 bytes and float32 scales; the offload engine moves those
    (``D + 4`` bytes a row, not ``4 D``) and gives them back with their dtype: the gradients are bitwise."""
    recipe = RECIPES["rowwise"]
    weight = nn.Parameter(torch.randn(2, 48, 32) * 0.1)
    x = torch.randn(10, 32)
    splits = RowSplits([4, 6])

    def run(engine: OffloadEngine | None) -> tuple[torch.Tensor, torch.Tensor]:
        weight.grad = None
        leaf = x.clone().requires_grad_()
        rows = float8_all_to_all(leaf, recipe, (10,), (10,), None, None)
        if engine is not None:
            engine.open_group()
        with _forward_regions.region("expert_fc1"):
            y = Float8GroupedLinear.apply(rows, weight, splits, False, recipe, None, ())
        if engine is not None:
            engine.close_group()
        y.pow(2).sum().backward()
        return leaf.grad, weight.grad.clone()

    engine = OffloadEngine(modules=["expert_fc1"], tensors=[], min_tensor_size=0, exclude=[weight])
    got, expected = run(engine), run(None)
    assert engine.stats.offloaded_tensors == 2  # the e4m3 rows and their scales
    assert engine.stats.offloaded_bytes == 10 * 32 + 10 * 4
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_other_dispatchers_keep_high_precision_rows() -> None:
    model = Holder(32)
    runtime = CommRuntime(communicator=Loopback(0.0))
    (ep,) = apply_expert_parallel(copy.deepcopy(model), None, runtime=runtime, dispatcher="allgather")
    apply_fp8(ep, "rowwise", dense=False)
    assert ep.dispatcher.fp8_dispatch is False and ep.dispatch_recipe() is None


@pytest.mark.parametrize("all_to_one", [False, True], ids=["random", "two-experts-empty"])
def test_deduplicated_rowwise_fp8_dispatch_is_bitwise_its_high_precision_dispatch_and_the_plain_fp8_one(
    all_to_one: bool,
) -> None:
    """Output, input and routing-weight gradients: bitwise those of the deduplicated high-precision dispatch (FP8
    GEMMs either way) and of the plain path's FP8 dispatch."""
    out, dx, dw, _, _, dweights = _run("rowwise", True, all_to_one=all_to_one, dedup=True)
    for fp8_dispatch, dedup in ((False, True), (True, False)):
        ref_out, ref_dx, ref_dw, _, _, ref_dweights = _run("rowwise", fp8_dispatch, all_to_one=all_to_one, dedup=dedup)
        assert torch.equal(out, ref_out) and torch.equal(dx, ref_dx), (fp8_dispatch, dedup)
        assert torch.equal(dw, ref_dw) and torch.equal(dweights, ref_dweights), (fp8_dispatch, dedup)


def test_deduplicated_dispatch_sends_its_unique_rows_in_fp8() -> None:
    """Collectives per call: counts, then at one comm point the rows and their routing data (bf16 weights and int32
    local experts apart), the combine (forward); the combine, then the rows' and the weights' gradients (backward)."""
    hidden = 32
    model = Holder(hidden)
    runtime = CommRuntime(communicator=Loopback(0.0))
    (ep,) = apply_expert_parallel(model, None, runtime=runtime, dedup=True)
    apply_fp8(ep, "rowwise", dense=False)
    x, indices = torch.randn(T, hidden), torch.randint(0, E, (T, K))
    x_RD, _, _ = ep.dispatcher.dispatch(x, indices, torch.rand(T, K), fp8=ep.dispatch_recipe())
    assert type(x_RD) is Float8Rows and x_RD.shape == (T * K, hidden)
    fp8 = _run("rowwise", True, hidden=hidden, dtype=torch.bfloat16, dedup=True)[3]
    bf16 = _run("rowwise", False, hidden=hidden, dtype=torch.bfloat16, dedup=True)[3]
    unique_rows = T  # one process: every token goes to its one destination once, whatever its K choices
    row, weights, local = 2 * hidden * unique_rows, 2 * K * unique_rows, 4 * K * unique_rows
    assert bf16[1:] == [row, weights, local, row, row, row, weights]
    # only the rows change: the routing data, the combine and every backward exchange stay as they were
    assert fp8 == [bf16[0], (hidden + 4) * unique_rows, *bf16[2:]]


def test_float8_rows_sent_with_other_tensors_then_gathered_per_assignment() -> None:
    """Oracles: the quantised rows indexed by ``assign // K`` and ``index_select``'s autograd for the rows' gradient;
    the float tensor sent beside them comes back unchanged with its own gradient, the integer one without."""
    recipe = RECIPES["rowwise"]
    x = torch.randn(5, 16, requires_grad=True)
    weights = torch.rand(5, 3, requires_grad=True)
    ids = torch.arange(5, dtype=torch.int32)
    rows, weights_M, ids_M = float8_all_to_all_many(x, (weights, ids), recipe, (5,), (5,), None, None)
    assign = torch.tensor([1, 0, 4, 9, 8, 5])  # flat (row, choice) ids with K = 2: rows 0, 0, 2, 4, 4, 2
    taken = gather_float8_rows(rows, assign, 2)
    q, scale = quantize_rows(x.detach(), recipe)
    index = torch.tensor([0, 0, 2, 4, 4, 2])
    assert type(taken) is Float8Rows and torch.equal(taken.scale, scale[index])
    assert torch.equal(taken.data_fp8.view(torch.uint8), q[index].view(torch.uint8))
    assert torch.equal(ids_M, ids) and not ids_M.requires_grad
    g, g_weights = torch.randn(6, 16), torch.randn(5, 3)
    x_grad, weights_grad = torch.autograd.grad((taken, weights_M), (x, weights), (g, g_weights))
    oracle = x.detach().clone().requires_grad_()
    oracle.index_select(0, index).backward(g)
    assert torch.equal(x_grad, oracle.grad) and torch.equal(weights_grad, g_weights)
