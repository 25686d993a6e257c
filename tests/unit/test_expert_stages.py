"""The stages of ``ExpertParallelExperts`` (``local``, ``fc1``, ``act``, ``fc2``) as modules: ordinary forward hooks,
``saved_tensors_hooks`` and ``torch.utils.checkpoint`` apply to them, wrappers come off in any order, and the
parameters, state-dict keys and results are what they were without stages."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_moe_overlap.callbacks import SavedActivationMeter
from lightning_moe_overlap.moe.ep import apply_expert_parallel
from lightning_moe_overlap.moe.ep import ExpertParallelExperts
from lightning_moe_overlap.moe.experts import Experts
from lightning_moe_overlap.moe.grouped import grouped_mlp
from lightning_moe_overlap.moe.experts_layout import ExpertsLayout
from lightning_moe_overlap.moe.stages import STAGE_NAMES, ExpertsStage
from lightning_moe_overlap.overlap.runtime import CommRuntime

T, K, D, F, E = 7, 2, 8, 6, 4


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.experts = Experts(E, D, F, dtype=torch.float64)


def build(**kwargs) -> tuple[Holder, ExpertParallelExperts]:
    holder = Holder()
    (ep,) = apply_expert_parallel(holder, None, runtime=CommRuntime(), **kwargs)
    return holder, ep


def routing() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, D, generator=g, dtype=torch.float64, requires_grad=True)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return x, idx, torch.rand(T, K, generator=g, dtype=torch.float64)


def step(holder: Holder) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """One forward and backward: the output, the gradients (input first) and the activation bytes held."""
    holder.zero_grad()
    x, idx, w = routing()
    with SavedActivationMeter(holder) as meter:
        out = holder.experts(x, idx, w)
    held = meter.held_bytes()
    out.square().sum().backward()
    return out.detach(), [x.grad, *(p.grad for p in holder.parameters())], held


def test_stages_hold_no_parameters_and_keep_the_keys() -> None:
    holder, ep = build()
    assert list(holder.state_dict()) == ["experts.gate_up_proj", "experts.down_proj"]
    assert [n for n, _ in ep.named_parameters()] == ["gate_up_proj", "down_proj"]
    stages = [n for n, m in ep.named_modules() if isinstance(m, ExpertsStage)]
    assert stages == ["stages.local", "stages.fc1", "stages.act", "stages.fc2"]
    assert all(ep.stage(name) is ep.stages[name] for name in STAGE_NAMES)
    with pytest.raises(ValueError, match=r"'fc3' is not a stage of the experts; the stages are \['local', 'fc1'"):
        ep.stage("fc3")


def test_stages_give_the_single_process_experts_result() -> None:
    """The staged path runs the unsharded ``Experts`` ops (ep=1: the same experts, the same order)."""
    holder, _ = build(impl="loop")
    reference = Holder()
    x, idx, w = routing()
    torch.testing.assert_close(holder.experts(x, idx, w), reference.experts(x, idx, w), rtol=1e-12, atol=1e-12)


def test_forward_hooks_see_every_stage_in_order() -> None:
    holder, ep = build()
    calls: list[tuple] = []
    for name in STAGE_NAMES:
        stage = ep.stage(name)
        stage.register_forward_pre_hook(lambda m, args: calls.append((m.name, "in", tuple(args[0].shape))))
        stage.register_forward_hook(lambda m, args, out: calls.append((m.name, "out", tuple(out.shape))))
    x, idx, w = routing()
    holder.experts(x, idx, w)
    rows = T * K  # ep=1, dropless: every (token, choice) pair
    assert calls == [
        ("local", "in", (rows, D)),
        ("fc1", "in", (rows, D)),
        ("fc1", "out", (rows, 2 * F)),
        ("act", "in", (rows, 2 * F)),
        ("act", "out", (rows, F)),
        ("fc2", "in", (rows, F)),
        ("fc2", "out", (rows, D)),
        ("local", "out", (rows, D)),
    ]


def test_saved_tensors_hooks_entered_in_stage_hooks_cover_that_stage_only() -> None:
    holder, ep = build()
    _, reference, _ = step(holder)
    packed: list[tuple[int, ...]] = []
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(tuple(t.shape)) or t, lambda t: t)
    act = ep.stage("act")
    act.register_forward_pre_hook(lambda m, args: hooks.__enter__())
    act.register_forward_hook(lambda m, args, out: hooks.__exit__(None, None, None), always_call=True)
    _, grads, _ = step(holder)
    # silu(gate) saves gate, the product saves silu(gate) and up: [R, F] each; nothing of fc1 / fc2 ([R, D], weights)
    assert packed and set(packed) == {(T * K, F)}
    assert all(torch.equal(a, b) for a, b in zip(grads, reference))


@pytest.mark.parametrize("name", ["local", "act"])
def test_a_checkpoint_wrapper_is_bitwise_and_holds_less(name: str) -> None:
    holder, ep = build()
    out, reference, held = step(holder)
    handle = ep.stage(name).add_wrapper(lambda fn: lambda *args: checkpoint(fn, *args, use_reentrant=False))
    assert ep.stage(name).wrapped
    got, grads, held_checkpointed = step(holder)
    assert torch.equal(got, out) and all(torch.equal(a, b) for a, b in zip(grads, reference))
    assert held_checkpointed < held
    handle.remove()
    assert not ep.stage(name).wrapped and step(holder)[2] == held


def test_checkpoint_of_a_stage_called_directly() -> None:
    """``torch.utils.checkpoint`` takes a stage like any module."""
    _, ep = build()
    h = torch.randn(5, 2 * F, dtype=torch.float64, requires_grad=True)
    expected = torch.autograd.grad(ep.stage("act")(h).sum(), h)[0]
    got = torch.autograd.grad(checkpoint(ep.stage("act"), h, use_reentrant=False).sum(), h)[0]
    assert torch.equal(got, expected)


def test_wrappers_nest_first_innermost_and_come_off_in_any_order() -> None:
    _, ep = build()
    act = ep.stage("act")
    h = torch.randn(3, 2 * F, dtype=torch.float64)
    plain = act(h)
    first = act.add_wrapper(lambda fn: lambda x: fn(x) + 1)
    second = act.add_wrapper(lambda fn: lambda x: fn(x) * 2)
    assert torch.equal(act(h), (plain + 1) * 2)
    first.remove()
    assert torch.equal(act(h), plain * 2)
    first.remove()  # removing twice is harmless
    second.remove()
    assert torch.equal(act(h), plain) and not act.wrapped


def test_a_deep_copy_runs_its_own_weights() -> None:
    holder, ep = build()
    twin = copy.deepcopy(holder)
    assert twin.experts.stage("fc1").compute.__self__ is twin.experts
    x, idx, w = routing()
    expected = holder.experts(x, idx, w)
    with torch.no_grad():
        twin.experts.down_proj.zero_()
    assert torch.equal(twin.experts(x, idx, w), torch.zeros_like(expected))
    assert torch.equal(holder.experts(x, idx, w), expected)


def test_construction_checks_impl_and_activation() -> None:
    with pytest.raises(ValueError, match=r"`ExpertParallelExperts`: impl='fast' is not one of \['auto', 'grouped_mm'"):
        build(impl="fast")
    _, ep = build()
    with pytest.raises(ValueError, match=r"act_fn=None and gate_fn=None; one of them must compute the experts'"):
        ExpertParallelExperts(Experts(E, D, F), ExpertsLayout(act_fn=None), ep.dispatcher)
    x = torch.randn(4, D)
    weights = Experts(E, D, F)
    with pytest.raises(ValueError, match=r"`grouped_mlp`: act_fn=None and gate_fn=None.*Give the element-wise"):
        grouped_mlp(x, [1, 1, 1, 1], weights.gate_up_proj, weights.down_proj, None)
