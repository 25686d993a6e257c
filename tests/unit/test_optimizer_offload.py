"""``OffloadedOptimizer`` in one process: which parameters go to the host, the update equal to the plain optimizer's
(bitwise on CPU), an LR scheduler on the user's optimizer, float32 masters of bfloat16 parameters, state loaded
where it lives (torch's ``load_state_dict`` and the state-dict API of the sharded checkpoint), state taken before
the wrap, and the validation rules of the offload.

Oracles: the plain optimizer on a copy of the same model; for the masters, AdamW run on a float32 copy whose values
are rounded to bfloat16 afterwards. On a CPU-only machine the "device" is the CPU: the host side is told apart by
the wrapper's bookkeeping (``state_bytes``) and the dtype of the state (float32 where the parameter is bfloat16).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.optim import OffloadedOptimizer, choose_offloaded, offload, offload_optimizers, state_bytes
from lightning_moe_overlap.validation import check_offload_optimizer, check_offload_settings, raise_problems

CPU = torch.device("cpu")


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dtype)


def _train(model: nn.Module, optimizer, steps: int = 4, scheduler=None, seed: int = 1) -> None:
    data = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=data).to(next(model.parameters()).dtype)
        optimizer.zero_grad()
        model(x).float().pow(2).mean().backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def _adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


# -- which parameters ------------------------------------------------------------------------------------------
def test_choose_offloaded_takes_the_largest_until_the_fraction():
    sizes = [3, 10, 1, 6, 0]  # 20 elements
    params = [nn.Parameter(torch.zeros(n)) for n in sizes]
    frozen = nn.Parameter(torch.zeros(100), requires_grad=False)
    chosen = lambda f: [p.numel() for p in choose_offloaded([*params, frozen], f)]  # noqa: E731
    assert chosen(0.5) == [10]  # 10 of 20 reach a half
    assert chosen(0.51) == [10, 6]
    assert chosen(0.05) == [10]
    assert chosen(1.0) == [10, 6, 3, 1]  # an empty parameter holds no state
    assert choose_offloaded([nn.Parameter(torch.zeros(4, device="meta"))], 1.0) == []


# -- the update ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fraction", [0.3, 0.5, 1.0])
def test_update_is_bitwise_the_plain_optimizers_with_an_lr_scheduler(fraction):
    plain, offloaded = _model(), _model()
    reference = _adamw(plain)
    _train(plain, reference, scheduler=torch.optim.lr_scheduler.StepLR(reference, 1, gamma=0.5))
    inner = _adamw(offloaded)
    scheduler = torch.optim.lr_scheduler.StepLR(inner, 1, gamma=0.5)  # built on the user's optimizer
    wrapped = offload(inner, fraction, CPU)
    _train(offloaded, wrapped, scheduler=scheduler)
    for a, b in zip(offloaded.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)
    assert wrapped.param_groups is inner.param_groups and wrapped.param_groups[0]["lr"] == 1e-2 * 0.5**4
    held, total = state_bytes(wrapped), state_bytes(reference)
    assert held.device + held.host == total.device and held.host >= fraction * total.device - 64  # step counters
    assert repr(wrapped).startswith("OffloadedOptimizer(AdamW, ")


def test_a_parameter_without_gradient_is_skipped_as_by_the_plain_optimizer():
    plain, offloaded = _model(), _model()
    reference, wrapped = _adamw(plain), offload(_adamw(offloaded), 1.0, CPU)
    for model, optimizer in ((plain, reference), (offloaded, wrapped)):
        optimizer.zero_grad()
        model[2](torch.ones(2, 16)).sum().backward()  # only the last layer gets gradients
        optimizer.step()
    for a, b in zip(offloaded.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)
    assert offloaded[0].weight not in wrapped.state and offloaded[2].weight in wrapped.state


def test_bf16_parameters_keep_float32_masters_on_the_host():
    fp32, bf16 = _model(), _model(torch.bfloat16)
    with torch.no_grad():
        for a, b in zip(fp32.parameters(), bf16.parameters()):
            a.copy_(b)  # the same starting values
    masters = _adamw(fp32)
    wrapped = offload(_adamw(bf16), 1.0, CPU)
    for step in range(4):  # the same gradients on both: those of the bf16 model, handed to the float32 one
        _train(bf16, wrapped, steps=1, seed=step)
        for a, b in zip(fp32.parameters(), bf16.parameters()):
            a.grad = b.grad.float()
        masters.step()
    for a, b in zip(fp32.parameters(), bf16.parameters(), strict=True):
        assert torch.equal(a.to(torch.bfloat16), b)
    assert {v.dtype for s in wrapped.state.values() for k, v in s.items() if k != "step"} == {torch.float32}
    with torch.no_grad():  # a write to the device parameter (a checkpoint load) is taken by the master
        bf16[0].bias.fill_(0.5)
    _train(bf16, wrapped, steps=1, seed=9)
    copy_ = wrapped.copies[id(bf16[0].bias)]
    assert copy_.master.dtype == torch.float32
    assert torch.allclose(copy_.master, torch.full_like(copy_.master, 0.5), atol=0.05)


# -- checkpoints ------------------------------------------------------------------------------------------------
def test_load_state_dict_puts_each_state_where_it_lives_and_continues_equal():
    plain, offloaded = _model(), _model()
    reference = _adamw(plain)
    _train(plain, reference, steps=6)
    source = _model()
    saved_by = _adamw(source)
    _train(source, saved_by, steps=3)
    offloaded.load_state_dict(source.state_dict())
    wrapped = offload(_adamw(offloaded), 0.5, CPU)
    wrapped.load_state_dict(copy.deepcopy(saved_by.state_dict()))  # written without the offload
    assert all(p in wrapped.state for p in offloaded.parameters())  # keyed by the model's parameters again
    assert [id(p) for g in wrapped.param_groups for p in g["params"]] == [id(p) for p in offloaded.parameters()]
    _train(offloaded, wrapped, steps=3, seed=1)
    _train(source, saved_by, steps=3, seed=1)
    for a, b in zip(offloaded.parameters(), source.parameters(), strict=True):
        assert torch.equal(a, b)


def test_bf16_state_loads_into_the_host_masters_dtype():
    model = _model(torch.bfloat16)
    plain = _adamw(model)
    _train(model, plain, steps=1)
    wrapped = offload(_adamw(model), 1.0, CPU)
    wrapped.load_state_dict(plain.state_dict())  # bfloat16 state, cast as torch casts to a parameter: the host copy's
    assert {v.dtype for s in wrapped.state.values() for k, v in s.items() if k != "step"} == {torch.float32}


def test_state_dict_api_round_trip():
    model = _model()
    wrapped = offload(_adamw(model), 0.5, CPU)
    fresh = get_optimizer_state_dict(model, wrapped)  # torch initialises the state with a step at lr 0 first
    assert set(fresh["state"]) == {n for n, _ in model.named_parameters()}
    _train(model, wrapped, steps=2)
    saved = copy.deepcopy(get_optimizer_state_dict(model, wrapped))
    other = _model()
    other.load_state_dict(model.state_dict())
    loaded = offload(_adamw(other), 0.5, CPU)
    set_optimizer_state_dict(other, loaded, saved)
    _train(model, wrapped, steps=2, seed=3)
    _train(other, loaded, steps=2, seed=3)
    for a, b in zip(other.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_state_taken_before_the_wrap_moves_to_the_host():
    plain, offloaded = _model(), _model()
    reference, inner = _adamw(plain), _adamw(offloaded)
    _train(plain, reference, steps=2)
    _train(offloaded, inner, steps=2)
    wrapped = offload(inner, 1.0, CPU)
    assert state_bytes(wrapped).device == 0
    _train(plain, reference, steps=2, seed=4)
    _train(offloaded, wrapped, steps=2, seed=4)
    for a, b in zip(offloaded.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)


# -- refusals ---------------------------------------------------------------------------------------------------
def test_offloading_a_parameter_the_optimizer_lacks_is_refused():
    with pytest.raises(ValueError, match=r"1 of the parameters to offload \(shapes \[\(3,\)\]\) are not in `AdamW`"):
        OffloadedOptimizer(_adamw(_model()), [nn.Parameter(torch.zeros(3))], CPU)


@pytest.mark.parametrize("fraction", [0, 0.0, -0.5, 1.5, math.nan, True, "half", None])
def test_fraction_outside_zero_one_is_refused(fraction):
    with pytest.raises(ValueError, match=r"`optimizer_offload_fraction=.*` must be a number in \(0, 1\].*Use 1.0"):
        raise_problems(check_offload_settings(True, fraction))
    with pytest.raises(ValueError, match=r"^`MoEOverlapStrategy`: `optimizer_offload_fraction="):
        MoEOverlapStrategy(optimizer_cpu_offload=True, optimizer_offload_fraction=fraction)


def test_fraction_without_offload_warns():
    problems = check_offload_settings(False, 0.5)
    assert [(p.rule, p.error) for p in problems] == [("offload-fraction-unused", None)]
    assert "Set `optimizer_cpu_offload=True`, or leave the fraction at 1.0" in problems[0].message
    assert check_offload_settings(False, 1.0) == [] and check_offload_settings(True, 0.5) == []
    with pytest.warns(UserWarning, match=r"`optimizer_offload_fraction=0.5` does nothing without"):
        assert MoEOverlapStrategy(optimizer_offload_fraction=0.5).config.offload_fraction is None


@pytest.mark.parametrize(
    "build,match",
    [
        (lambda ps: torch.optim.LBFGS(ps), r"cannot wrap `LBFGS`: its `step` re-evaluates the closure"),
        (lambda ps: torch.optim.SparseAdam(ps), r"cannot wrap `SparseAdam`: it takes sparse gradients"),
        (lambda ps: offload(torch.optim.SGD(ps, lr=0.1), 1.0, CPU), r"cannot wrap `OffloadedOptimizer`: it is off"),
        (lambda ps: object(), r"needs a `torch.optim.Optimizer`; `configure_optimizers` returned a `object`"),
    ],
)
def test_an_optimizer_it_cannot_wrap_is_refused_by_name(build, match):
    optimizer = build(list(_model().parameters()))
    with pytest.raises(TypeError, match=match + r".*Return such an optimizer.*or set `optimizer_cpu_offload=False`"):
        offload_optimizers([optimizer], 1.0, CPU)
    assert [p.rule for p in check_offload_optimizer(optimizer)] == ["offload-optimizer"]
    assert check_offload_optimizer(_adamw(_model())) == []


def test_an_optimizer_bound_to_the_accelerator_is_refused_by_name():
    """``capturable=True``: torch's own update asserts that the parameters are on an accelerator (the host copies of
    an offload are not), which the oracle below shows on this machine's CPU parameters."""
    params = list(_model().parameters())
    captured = torch.optim.AdamW(params, capturable=True)
    for p in params:
        p.grad = torch.zeros_like(p)
    with pytest.raises(Exception, match=r"capturable"):
        captured.step()  # torch's own rule, on host tensors
    problems = check_offload_optimizer(torch.optim.AdamW(params, capturable=True))
    assert [p.rule for p in problems] == ["offload-optimizer-device-state"]
    with pytest.raises(TypeError, match=r"cannot wrap `AdamW` with `capturable=True` \(group 0\): torch's update then "
                                        r"asserts.*Use `capturable=False` and a float learning rate"):
        offload_optimizers([torch.optim.AdamW(params, capturable=True)], 1.0, CPU)
