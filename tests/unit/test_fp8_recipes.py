"""FP8 recipes as data, their name resolution and its errors, and current scaling (amax -> scale, saturating cast)."""

from __future__ import annotations

import pytest
import torch

from lightning_moe_overlap.fp8 import RECIPES, Float8Recipe, fp8_matmul, resolve_recipe
from lightning_moe_overlap.float8.scaling import amax_to_scale, dequantize, quantize

E4M3_MAX, E5M2_MAX = 448.0, 57344.0  # the formats' largest finite values (OCP FP8 spec)


def test_recipes_cast_forward_in_e4m3_and_gradients_as_stated() -> None:
    tensorwise, rowwise = resolve_recipe("tensorwise"), resolve_recipe("rowwise")
    assert (tensorwise.dtype("input"), tensorwise.dtype("weight"), tensorwise.dtype("grad")) == (
        torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float8_e5m2,
    )  # fmt: skip
    assert {rowwise.dtype(role) for role in ("input", "weight", "grad")} == {torch.float8_e4m3fn}
    assert (tensorwise.granularity, rowwise.granularity) == ("tensor", "row")
    assert rowwise.power_of_2_scales and not tensorwise.power_of_2_scales
    custom = Float8Recipe("mine", "row", torch.float8_e4m3fn, torch.float8_e5m2, False)
    assert resolve_recipe(custom) is custom


@pytest.mark.parametrize("name", ["delayed"])
def test_recipes_that_need_transformer_engine_are_refused_with_the_fix(name: str) -> None:
    with pytest.raises(NotImplementedError, match=rf"recipe='{name}' on device 'cpu'.*Transformer Engine.*'rowwise'"):
        resolve_recipe(name, "cpu")


def test_unknown_recipe_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"recipe='blockwise' is not a known recipe; the recipes are \['tensorwise'"):
        resolve_recipe("blockwise")


def test_zero_tensor_gets_a_finite_scale_and_quantises_to_zeros() -> None:
    for recipe in RECIPES.values():
        q, scale = quantize(torch.zeros(4, 32), recipe, "input")
        assert torch.isfinite(scale).all() and (scale > 0).all()
        assert torch.equal(q.float(), torch.zeros(4, 32))
        assert torch.equal(fp8_matmul(torch.zeros(3, 32), torch.randn(5, 32), recipe, ("input", "weight"),
                                      torch.float32), torch.zeros(3, 5))  # fmt: skip


def test_largest_entry_maps_to_the_top_of_the_range() -> None:
    x = torch.tensor([[0.5, -3.0, 1.0], [2.0, 0.25, -0.125]])
    q, scale = quantize(x, RECIPES["tensorwise"], "input")
    assert scale.dim() == 0 and scale.item() == pytest.approx(3.0 / E4M3_MAX)
    assert q.float().abs().max().item() == E4M3_MAX
    q, scale = quantize(x, RECIPES["tensorwise"], "grad")  # e5m2
    assert q.dtype == torch.float8_e5m2 and q.float().abs().max().item() == E5M2_MAX


def test_rowwise_scales_are_powers_of_two_that_still_fit_each_row() -> None:
    x = torch.tensor([[0.5, -3.0, 1.0], [2.0, 0.25, -0.125], [1e-3, 0.0, 0.0]])
    q, scale = quantize(x, RECIPES["rowwise"], "input")
    assert scale.shape == (3, 1)
    exponent = torch.log2(scale)
    assert torch.equal(exponent, exponent.round())  # a power of two
    amax = x.abs().amax(dim=1, keepdim=True)
    assert (amax / scale <= E4M3_MAX).all() and (amax / scale > E4M3_MAX / 2).all()  # rounded up, by < 2x
    assert torch.allclose(dequantize(q, scale), x, rtol=2**-3)


def test_amax_to_scale_clamps_a_zero_amax() -> None:
    assert amax_to_scale(torch.tensor(0.0), torch.float8_e4m3fn).item() == pytest.approx(1e-12 / E4M3_MAX)


def test_fp8_matmul_refuses_an_output_dtype_the_kernels_do_not_write() -> None:
    with pytest.raises(TypeError, match=r"out_dtype=torch.float64 is not one the FP8 kernels write"):
        fp8_matmul(torch.randn(2, 16), torch.randn(3, 16), RECIPES["tensorwise"], ("input", "weight"), torch.float64)
