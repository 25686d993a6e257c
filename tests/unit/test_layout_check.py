"""Wrap-time checks of an adapter's layout: its math against the module's own forward, and its names against the
module's tensors (a list of per-expert modules is not an experts module)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import Tensor, nn

from lightning_moe_overlap.moe import (
    ExpertParallelExperts,
    Experts,
    ExpertsLayout,
    MoELayer,
    apply_expert_parallel,
    find_moe_blocks,
    register_experts_adapter,
)
from lightning_moe_overlap.moe.adapters import ADAPTERS
from lightning_moe_overlap.moe.layout_check import check_routing, layout_experts_forward
from lightning_moe_overlap.overlap.runtime import CommRuntime


def relu2(h: Tensor) -> Tensor:
    return torch.relu(h).square()


class SquareExperts(nn.Module):
    """A user's experts module: ``w_in [E, in, out]``, ``w_out [E, in, out]`` (square by default: D == F), ReLU^2, no
    gate.
    Its forward is written out per expert, independently of the package's math: the oracle."""

    def __init__(self, num_experts: int = 4, dim: int = 8, device: str | torch.device = "cpu", ffn: int = 8) -> None:
        super().__init__()
        factory = {"dtype": torch.float64, "device": device}
        self.w_in = nn.Parameter(torch.randn(num_experts, dim, ffn, **factory))
        self.w_out = nn.Parameter(torch.randn(num_experts, ffn, dim, **factory))

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        out = torch.zeros_like(hidden_states)
        for e in range(self.w_in.shape[0]):
            t, k = torch.where(top_k_index == e)
            y = relu2(hidden_states[t] @ self.w_in[e]) @ self.w_out[e]
            out = out.index_add(0, t, y * top_k_weights[t, k, None])
        return out


class RaisingExperts(SquareExperts):
    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        raise RuntimeError("needs a context this check does not set up")


def _register(act_fn=relu2, transposed: bool = True, kind: type[nn.Module] = SquareExperts) -> None:
    register_experts_adapter(
        "square",
        matches=lambda m: type(m) is kind,
        layout=lambda m: ExpertsLayout(
            act_fn=act_fn, up_name="w_in", down_name="w_out", transposed=transposed, gated=False
        ),
    )


def _model(experts: nn.Module) -> nn.ModuleDict:
    return nn.ModuleDict({"block": nn.ModuleDict({"experts": experts})})


def test_a_right_layout_passes_and_the_wrapped_module_matches_the_forward() -> None:
    torch.manual_seed(0)
    experts = SquareExperts()
    x = torch.randn(6, 8, dtype=torch.float64)
    idx = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 3], [0, 2], [1, 2]])
    w = torch.rand(6, 2, dtype=torch.float64)
    expected = experts(x, idx, w)
    with ADAPTERS.scoped():
        _register()
        (ep,) = apply_expert_parallel(_model(experts), None, runtime=CommRuntime())
    torch.testing.assert_close(ep(x, idx, w), expected)


@pytest.mark.parametrize(
    ("act_fn", "transposed"), [(relu2, False), (torch.relu, True)], ids=["transposed-flag", "act-fn"]
)
def test_a_wrong_layout_raises_naming_the_module_and_the_difference(act_fn, transposed: bool) -> None:
    torch.manual_seed(0)
    model = _model(SquareExperts())
    with ADAPTERS.scoped():
        _register(act_fn=act_fn, transposed=transposed)
        with pytest.raises(ValueError) as raised:
            apply_expert_parallel(model, None, runtime=CommRuntime())
    message = str(raised.value)
    assert "`block.experts` (SquareExperts), matched by adapter 'square'" in message
    assert "max abs difference" in message and "tolerance" in message
    assert "Check the adapter's ExpertsLayout fields: act_fn, transposed" in message
    assert type(model["block"]["experts"]) is SquareExperts  # nothing was replaced


def test_the_mismatch_is_the_one_the_forward_shows() -> None:
    """The difference in the error is the one between the module's forward and what the wrapped module computes."""
    torch.manual_seed(0)
    experts = SquareExperts()
    generator = torch.Generator().manual_seed(0)
    idx = check_routing(4, 4, 2)
    w = (torch.rand(idx.shape, generator=generator) + 0.5).double()  # the check's draws, in its order
    x = torch.randn(4, 8, generator=generator).double()
    wrong = ExpertsLayout(act_fn=relu2, up_name="w_in", down_name="w_out", transposed=False, gated=False)
    with torch.no_grad():
        diff = (layout_experts_forward(experts, wrong, x, idx, w) - experts(x, idx, w)).abs().max().item()
    with ADAPTERS.scoped():
        _register(transposed=False)
        with pytest.raises(ValueError, match=f"max abs difference {diff:.3g} > tolerance"):
            apply_expert_parallel(_model(experts), None, runtime=CommRuntime())


def test_a_wrong_transposed_flag_with_non_square_weights_raises() -> None:
    """The forward runs with the hidden size of the other orientation: the check is not skipped."""
    torch.manual_seed(0)
    with ADAPTERS.scoped():
        _register(transposed=False)
        with pytest.raises(ValueError, match=r"`block.experts` \(SquareExperts\).*its layout's math fails on them"):
            apply_expert_parallel(_model(SquareExperts(ffn=6)), None, runtime=CommRuntime())


def test_meta_device_modules_are_not_checked() -> None:
    experts = SquareExperts(device="meta")
    with ADAPTERS.scoped():
        _register(transposed=False)  # wrong, but the module cannot run: no check
        (ep,) = apply_expert_parallel(_model(experts), None, runtime=CommRuntime())
    assert ep.w_in.is_meta


def test_a_module_whose_forward_raises_is_not_checked(caplog: pytest.LogCaptureFixture) -> None:
    with ADAPTERS.scoped(), caplog.at_level(logging.DEBUG, logger="lightning_moe_overlap.moe.layout_check"):
        _register(transposed=False, kind=RaisingExperts)
        (ep,) = apply_expert_parallel(_model(RaisingExperts()), None, runtime=CommRuntime())
    assert isinstance(ep, ExpertParallelExperts)
    assert "layout check skipped" in caplog.text


def test_built_in_experts_pass_the_check_in_low_precision() -> None:
    model = nn.Sequential(MoELayer(16, 32, 8, 2), MoELayer(16, 32, 8, 2)).to(torch.bfloat16)
    assert len(apply_expert_parallel(model, None, runtime=CommRuntime())) == 2


def test_the_check_does_not_move_the_global_rng() -> None:
    model = nn.ModuleDict({"experts": Experts(4, 8, 4)})
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    apply_expert_parallel(model, None, runtime=CommRuntime())
    assert torch.equal(torch.rand(3), expected)


def test_check_routing_reaches_every_expert_it_can() -> None:
    assert sorted(check_routing(8, 4, 2).flatten().tolist()) == list(range(8))
    assert set(check_routing(3, 4, 2).flatten().tolist()) == {0, 1, 2}
    big = check_routing(64, 4, 2)
    assert big.dtype == torch.int64 and len(set(big.flatten().tolist())) == 8
    assert all(row[0] != row[1] for row in check_routing(2, 4, 2).tolist())


# -- a list of per-expert modules ------------------------------------------------------------------------------
class ExpertMLP(nn.Module):
    def __init__(self, dim: int = 8, ffn: int = 16) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn, bias=False)
        self.up_proj = nn.Linear(dim, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class ListMoEBlock(nn.Module):
    """HF v4 style: a router next to ``experts = nn.ModuleList([...per-expert MLPs...])``."""

    def __init__(self, num_experts: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(8, num_experts, bias=False)
        self.experts = nn.ModuleList(ExpertMLP() for _ in range(num_experts))


def _list_model() -> nn.Module:
    return nn.ModuleDict({"layers": nn.ModuleList([nn.ModuleDict({"mlp": ListMoEBlock()})])})


def test_a_list_of_expert_modules_is_left_alone_without_an_adapter() -> None:
    model = _list_model()
    assert find_moe_blocks(model) == {} and apply_expert_parallel(model, None, runtime=CommRuntime()) == []


@pytest.mark.parametrize("target", ["block", "list"])
def test_an_adapter_for_a_list_of_expert_modules_raises_a_clear_error(target: str) -> None:
    with ADAPTERS.scoped():
        if target == "block":  # the block's `experts` named as the weights
            register_experts_adapter(
                "listed",
                matches=lambda m: isinstance(m, ListMoEBlock),
                layout=lambda m: ExpertsLayout(act_fn=torch.relu, up_name="experts", down_name="experts"),
            )
            name, kind = "layers.0.mlp", "ListMoEBlock"
        else:  # the list itself matched, with the default names
            register_experts_adapter(
                "listed",
                matches=lambda m: isinstance(m, nn.ModuleList) and isinstance(m[0], ExpertMLP),
                layout=lambda m: ExpertsLayout(act_fn=torch.relu),
            )
            name, kind = "layers.0.mlp.experts", "ModuleList"
        for call in (find_moe_blocks, lambda m: apply_expert_parallel(m, None, runtime=CommRuntime())):
            with pytest.raises(TypeError) as raised:
                call(_list_model())
            message = str(raised.value)
            assert f"`{name}` ({kind}), matched by adapter 'listed'" in message
            assert "a list of per-expert modules" in message and "is not supported" in message
            assert "first dimension is the expert" in message and "Stack the experts' weights into 3-D" in message


def test_projections_must_be_3d() -> None:
    class FlatExperts(nn.Module):  # DBRX style: [E * F, D]
        def __init__(self) -> None:
            super().__init__()
            self.w1 = nn.Parameter(torch.zeros(4 * 16, 8))
            self.w2 = nn.Parameter(torch.zeros(4 * 16, 8))

    with ADAPTERS.scoped():
        register_experts_adapter(
            "flat",
            matches=lambda m: isinstance(m, FlatExperts),
            layout=lambda m: ExpertsLayout(act_fn=torch.relu, up_name="w1", down_name="w2"),
        )
        with pytest.raises(TypeError, match=r"`e` \(FlatExperts\), matched by adapter 'flat': the projections "):
            find_moe_blocks(nn.ModuleDict({"e": FlatExperts()}))
