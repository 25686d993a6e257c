"""Each rule once: one capacity drop per layer forward, one capacity rule and one experts-per-ep rule for every
caller, and the dispatcher's balanced hand-overs decided by the dispatcher (ep=1, no process group).

The drop count is read by a counting wrapper around ``drop_over_capacity``, put in place of the function wherever
the package holds it, so the count does not depend on which module calls it.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch import Tensor, nn

from lightning_moe_overlap.config import OverlapConfig
from lightning_moe_overlap.moe import ExpertParallelExperts, Experts, MoELayer, apply_expert_parallel, layout_of
from lightning_moe_overlap.moe import capacity as capacity_module
from lightning_moe_overlap.moe.dispatch import AllToAllDispatcher
from lightning_moe_overlap.moe.grouped import RowSplits
from lightning_moe_overlap.overlap.runtime import CommRuntime
from lightning_moe_overlap.validation import check_config, check_model
from tests.unit.test_adapters import _hf
from tests.unit.test_dispatch_flex import CountingRuntime

E, D, F, K = 4, 8, 6, 2


@pytest.fixture
def drops(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every call of ``drop_over_capacity`` appends its token count, whichever module of the package calls it."""
    original = capacity_module.drop_over_capacity
    calls: list[int] = []

    def counting(indices_TK: Tensor, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(indices_TK.shape[0])
        return original(indices_TK, *args, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith("lightning_moe_overlap") and getattr(module, "drop_over_capacity", None) is original:
            monkeypatch.setattr(module, "drop_over_capacity", counting)
    return calls


# -- one capacity drop per layer -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("layer_factor", "wrap_factor"), [(1.0, None), (None, 1.0), (1.0, 1.0)], ids=["layer", "wrap", "both-same"]
)
def test_moe_layer_drops_once_per_forward(drops: list[int], layer_factor, wrap_factor) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(MoELayer(D, F, E, K, capacity_factor=layer_factor) for _ in range(2))).double()
    ref = copy.deepcopy(model)
    for layer in ref:
        layer.capacity_factor = 1.0  # the unsharded layers, each dropping itself once
    apply_expert_parallel(model, None, runtime=CommRuntime(), capacity_factor=wrap_factor)
    x = torch.randn(3, 5, D, dtype=torch.float64)
    want = ref(x)
    drops.clear()
    got = model(x)
    assert drops == [15, 15]  # one drop per layer, on its 3 * 5 tokens
    torch.testing.assert_close(got, want)


def test_hf_blocks_drop_once_per_forward(drops: list[int]) -> None:
    model = _hf("qwen3_moe")  # two MoE layers
    apply_expert_parallel(model, None, runtime=CommRuntime(), capacity_factor=1.0)
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids)
    assert drops == [12, 12]


def test_a_second_capacity_setting_for_a_layer_is_refused_before_any_change() -> None:
    model = nn.Sequential(MoELayer(D, F, E, K, capacity_factor=1.0, token_drop_policy="probs"))
    for kwargs in ({"capacity_factor": 2.0}, {"capacity_factor": 1.0, "token_drop_policy": "position"}):
        with pytest.raises(
            ValueError,
            match=r"\(0\.experts\): capacity_factor=.*given here, but its `MoELayer` drops with capacity_factor=1\.0, "
            r"token_drop_policy='probs'; a layer drops over capacity once.*Set the capacity in one place",
        ):
            apply_expert_parallel(model, None, runtime=CommRuntime(), **kwargs)
        assert isinstance(model[0].experts, Experts)  # nothing swapped


# -- one capacity rule, one experts-per-ep rule ------------------------------------------------------------------
@pytest.mark.parametrize(("factor", "policy"), [(0.0, "probs"), (-2, "probs"), (1.0, "first")])
def test_strategy_and_layer_state_the_capacity_rule_alike(factor, policy) -> None:
    with pytest.raises(ValueError) as layer_error:
        MoELayer(D, F, E, K, capacity_factor=factor, token_drop_policy=policy)
    rule = "choices" if policy == "first" else "capacity-factor"
    cfg = OverlapConfig(capacity_factor=factor, token_drop_policy=policy)
    (problem,) = [p for p in check_config(cfg) if p.rule == rule]
    assert str(layer_error.value).removeprefix("`MoELayer`: ") == problem.message.removeprefix(
        "`MoEOverlapStrategy`: "
    )


@pytest.mark.parametrize(("num_experts", "ep", "ok"), [(8, 4, True), (6, 4, False), (3, 2, False), (4, 1, True)])
def test_experts_per_ep_rule_agrees_everywhere(num_experts: int, ep: int, ok: bool) -> None:
    """The strategy's model check and the wrap refuse the same sizes (a rank must own E / ep experts)."""
    found = check_model(OverlapConfig(ep=ep), {"experts": num_experts})
    assert (not found) is ok
    if ep == 1:
        experts = apply_expert_parallel(nn.ModuleDict({"e": Experts(num_experts, D, F)}), None)
        assert experts[0].num_local_experts == num_experts


# -- the dispatcher's contract -----------------------------------------------------------------------------------
class ThreeCountsDispatcher(AllToAllDispatcher):
    """An all-to-all dispatcher that says three forward comm points have no backward twin."""

    backward_handoffs = 3


@pytest.mark.parametrize("cls", [AllToAllDispatcher, ThreeCountsDispatcher])
def test_experts_hand_over_as_their_dispatcher_says(cls: type[AllToAllDispatcher]) -> None:
    torch.manual_seed(0)
    runtime = CountingRuntime()
    source = Experts(E, D, F, dtype=torch.float64)
    experts = ExpertParallelExperts(source, layout_of(source), cls(None, E, runtime))
    x = torch.randn(5, D, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3], [1, 0]])
    out = experts(x, idx, torch.rand(5, K, dtype=torch.float64))
    forward = runtime.handoffs
    out.sum().backward()
    assert forward == 3  # counts, tokens, combine
    assert runtime.handoffs - forward == 2 + cls.backward_handoffs  # combine, tokens, then the balance


def test_dispatch_returns_row_splits_on_the_host_path() -> None:
    dispatcher = AllToAllDispatcher(None, E, None)
    idx = torch.tensor([[0, 1], [1, 1], [3, 0]])
    x_RD, splits, _ = dispatcher.dispatch(torch.randn(3, D), idx, torch.ones(3, K))
    assert isinstance(splits, RowSplits) and splits.sorted
    assert splits.host_sizes() == (2, 3, 0, 1) and x_RD.shape[0] == 6
