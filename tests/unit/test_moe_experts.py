"""Experts: the grouped path against the per-expert loop, the grouped MLP's layouts, and delayed weight gradients."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from lightning_moe_overlap.moe import Experts, grouped_mlp
from lightning_moe_overlap.moe.grouped import grouped_mm_supported
from lightning_moe_overlap.overlap.runtime import CommRuntime

E, D, F, T = 4, 16, 8, 10


def _routing(T: int, K: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return idx, torch.rand(T, K, generator=g)


def _pair(dtype: torch.dtype) -> tuple[Experts, Experts]:
    torch.manual_seed(0)
    loop = Experts(E, D, F, impl="loop", dtype=dtype)
    grouped = Experts(E, D, F, impl="grouped", dtype=dtype)
    grouped.load_state_dict(loop.state_dict())
    return loop, grouped


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("top_k", [1, 2])
def test_grouped_matches_loop_forward_and_backward(
    dtype: torch.dtype, top_k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    loop, grouped = _pair(dtype)
    idx, w = _routing(T, top_k)
    idx[0, 0] = E  # a dropped choice (HF's marker) contributes nothing
    idx[1:4, 0] = 2  # a busy expert
    x = torch.randn(T, D, dtype=dtype)
    outs, grads = [], []
    for module in (loop, grouped):
        xi, wi = x.clone().requires_grad_(), w.to(dtype).requires_grad_()
        out = module(xi, idx, wi)
        out.backward(torch.ones_like(out))
        outs.append(out)
        grads.append([xi.grad, wi.grad, module.gate_up_proj.grad, module.down_proj.grad])
    tol = {"atol": 1e-12, "rtol": 1e-12} if dtype == torch.float64 else {}
    torch.testing.assert_close(outs[1], outs[0], **tol)
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, **tol)
    assert grads[0][1][0, 0] == 0  # the dropped choice's weight gets no gradient
    # float32 with 16-byte aligned sizes runs torch._grouped_mm (forward, dgrad and wgrad of both projections).
    assert len(calls) == (6 if dtype == torch.float32 else 0)


def test_grouped_mm_support_rules() -> None:
    w = torch.zeros(2, 8, 16)
    assert grouped_mm_supported(torch.zeros(3, 16), w)
    assert not grouped_mm_supported(torch.zeros(3, 16, dtype=torch.float64), w.double())
    assert not grouped_mm_supported(torch.zeros(3, 6), torch.zeros(2, 8, 6))  # 24-byte rows
    assert not grouped_mm_supported(torch.zeros(0, 16), w)  # no rows


def _reference_mlp(x, counts, w1, w2, act, transposed, b1=None, b2=None, gate=None, gated=True):
    outs, start = [], 0
    for e, n in enumerate(counts):
        xe = x[start : start + n]
        start += n
        h = xe @ w1[e] if transposed else xe @ w1[e].T
        if b1 is not None:
            h = h + b1[e]
        if gate is not None:
            h = gate(h)
        elif gated:
            g, u = h.chunk(2, dim=-1)
            h = act(g) * u
        else:
            h = act(h)
        y = h @ w2[e] if transposed else h @ w2[e].T
        if b2 is not None:
            y = y + b2[e]
        outs.append(y)
    return torch.cat(outs)


@pytest.mark.parametrize("variant", ["plain", "transposed_bias_custom_gate", "ungated", "empty_experts"])
def test_grouped_mlp_layouts_match_per_expert_reference(variant: str) -> None:
    torch.manual_seed(0)
    dtype = torch.float64
    transposed = variant.startswith("transposed")
    gated = variant != "ungated"
    up_out = 2 * F if gated else F
    w1 = torch.randn(E, D, up_out, dtype=dtype) if transposed else torch.randn(E, up_out, D, dtype=dtype)
    w2 = torch.randn(E, F, D, dtype=dtype) if transposed else torch.randn(E, D, F, dtype=dtype)
    b1 = torch.randn(E, up_out, dtype=dtype) if "bias" in variant else None
    b2 = torch.randn(E, D, dtype=dtype) if "bias" in variant else None

    def gate(h: Tensor) -> Tensor:  # GPT-OSS style: interleaved, clamped
        g, u = h[..., ::2].clamp(max=7.0), h[..., 1::2].clamp(-7.0, 7.0)
        return (u + 1) * g * torch.sigmoid(1.702 * g)

    gate_fn = gate if "custom_gate" in variant else None
    counts = [0, 9, 0, 0] if variant == "empty_experts" else [3, 0, 5, 2]
    x = torch.randn(sum(counts), D, dtype=dtype)
    leaves = [t.requires_grad_() for t in (x, w1, w2, b1, b2) if t is not None]
    act = torch.nn.functional.silu
    got = grouped_mlp(
        x, counts, w1, w2, act, None, transposed=transposed, gate_up_bias=b1, down_bias=b2, gate_fn=gate_fn, gated=gated
    )
    want = _reference_mlp(x, counts, w1, w2, act, transposed, b1, b2, gate_fn, gated)
    torch.testing.assert_close(got, want)
    g = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, leaves, g), torch.autograd.grad(want, leaves, g)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_delayed_wgrad_is_bitwise_equal_to_inline(dtype: torch.dtype) -> None:
    """Same kernels in the same order: the flushed ``.grad`` equals the inline one bit for bit, accumulation too."""
    idx, w = _routing(T, 2, seed=3)
    x = torch.randn(T, D, dtype=dtype)
    results = []
    for delay in (False, True):
        _, experts = _pair(dtype)
        runtime = CommRuntime(delay_wgrad=delay)
        experts.runtime = runtime
        for step in range(2):  # the second backward accumulates into existing .grad
            out = experts(x.clone().requires_grad_(), idx, w.to(dtype))
            out.square().sum().backward()
            if delay:
                assert runtime.pending_wgrad == 2  # down and gate/up
                assert step == 1 or experts.gate_up_proj.grad is None
                runtime.flush_wgrad()
            assert runtime.pending_wgrad == 0
        results.append([experts.gate_up_proj.grad, experts.down_proj.grad])
    for inline, delayed in zip(*results):
        assert delayed.grad_fn is None and not delayed.requires_grad
        assert torch.equal(inline, delayed)


def test_non_leaf_weight_takes_the_inline_path() -> None:
    runtime = CommRuntime(delay_wgrad=True)
    base = torch.randn(E, 2 * F, D, requires_grad=True)
    w1 = base * 1.0  # not a leaf: there is no .grad the deferred closure could write
    w2 = torch.randn(E, D, F, requires_grad=True)
    x = torch.randn(6, D)
    grouped_mlp(x, [1, 2, 3, 0], w1, w2, torch.nn.functional.silu, runtime).sum().backward()
    assert runtime.pending_wgrad == 1  # only the leaf w2
    assert base.grad is not None and w2.grad is None
    runtime.flush_wgrad()
    assert w2.grad is not None


def test_grouped_mlp_errors() -> None:
    w1, w2, x = torch.randn(E, 2 * F, D), torch.randn(E, D, F), torch.randn(5, D)
    with pytest.raises(ValueError, match=r"impl='fast' is not one of"):
        grouped_mlp(x, [5, 0, 0, 0], w1, w2, torch.relu, impl="fast")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"tokens_per_expert has 4 entries summing to 4, but there are 4 experts and 5 rows"
    ):
        grouped_mlp(x, [4, 0, 0, 0], w1, w2, torch.relu)
    with pytest.raises(ValueError, match=r"tokens_per_expert has 2 entries"):
        grouped_mlp(x, [4, 1], w1, w2, torch.relu)
    with pytest.raises(ValueError, match="act_fn=None and gate_fn=None"):
        grouped_mlp(x, [5, 0, 0, 0], w1, w2, None)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_experts": 0}, "num_experts=0 must be a positive integer"),
        ({"hidden_size": 2.0}, "hidden_size=2.0 must be a positive integer"),
        ({"impl": "fast"}, "impl='fast' is not 'grouped' or 'loop'"),
        ({"activation": "swish"}, r"activation='swish' is not a known activation name"),
    ],
)
def test_experts_validation(kwargs: dict, match: str) -> None:
    args = {"num_experts": E, "hidden_size": D, "ffn_hidden_size": F, **kwargs}
    with pytest.raises(ValueError, match=match):
        Experts(args.pop("num_experts"), args.pop("hidden_size"), args.pop("ffn_hidden_size"), **args)
