"""``ExpertParallelPrecision``: the user's plugin behind every hook, the norm clip by the strategy's global norm.

The multi-rank oracle of the clip itself (losses follow a single-process run clipped by ``clip_grad_norm_``) is
``tests/distributed/test_hf_strategy.py``; here, one process: routes, forwarding, checkpoints, the strategy's setter.
"""

from __future__ import annotations

import inspect

import lightning
import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.precision import ExpertParallelPrecision


def _params() -> list[torch.nn.Parameter]:
    param = torch.nn.Parameter(torch.zeros(3))
    param.grad = torch.tensor([3.0, -4.0, 0.5])
    return [param]


def test_every_precision_hook_is_forwarded_or_answered() -> None:
    hooks = {n for n, v in inspect.getmembers(Precision, inspect.isfunction) if not n.startswith("_")}
    missing = sorted(n for n in hooks if getattr(ExpertParallelPrecision, n) is getattr(Precision, n))
    assert not missing, (
        f"lightning {lightning.__version__}: `Precision` has hooks `ExpertParallelPrecision` does not forward to the "
        f"wrapped plugin: {missing}; add them to `lightning_moe_overlap/precision.py`"
    )


def test_norm_clip_goes_to_the_global_norm_and_value_clip_to_the_wrapped_plugin() -> None:
    calls = []
    plugin = ExpertParallelPrecision(Precision(), lambda opt, max_norm: calls.append((opt, max_norm)))
    params = _params()
    opt = torch.optim.SGD(params, lr=0.1)
    plugin.clip_gradients(opt, 0.0)  # 0 means off, as in Lightning
    plugin.clip_gradients(opt, 2)
    assert calls == [(opt, 2.0)] and isinstance(calls[0][1], float)
    assert torch.equal(params[0].grad, torch.tensor([3.0, -4.0, 0.5]))  # the wrapped plugin's norm clip never ran
    plugin.clip_gradients(opt, 1.0, gradient_clip_algorithm="value")
    assert torch.equal(params[0].grad, torch.tensor([1.0, -1.0, 0.5])) and len(calls) == 1


def test_norm_clip_of_still_scaled_gradients_is_refused() -> None:
    plugin = ExpertParallelPrecision(MixedPrecision("16-mixed", "cpu"), lambda opt, max_norm: None)
    opt = torch.optim.SGD(_params(), lr=0.1)
    opt._step_supports_amp_scaling = True  # a fused optimizer: it unscales inside its own step
    with pytest.raises(RuntimeError, match=r"`gradient_clip_val=1.0` with `SGD`, which unscales gradients inside"):
        plugin.clip_gradients(opt, 1.0)


def test_hooks_are_the_wrapped_plugins() -> None:
    mixed = ExpertParallelPrecision(MixedPrecision("bf16-mixed", "cpu"), lambda *a: None)
    assert mixed.precision == "bf16-mixed"
    with mixed.train_step_context():
        assert torch.is_autocast_enabled("cpu")
    with mixed.val_step_context():
        assert torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")
    half = ExpertParallelPrecision(HalfPrecision("bf16-true"), lambda *a: None)
    assert half.convert_module(torch.nn.Linear(2, 2)).weight.dtype == torch.bfloat16
    assert half.convert_input(torch.ones(2)).dtype == torch.bfloat16


def test_checkpoint_state_is_stored_under_the_wrapped_plugins_name() -> None:
    wrapped = MixedPrecision("16-mixed", "cpu")
    wrapped.scaler.scale(torch.ones(1))  # the scale exists once a loss was scaled
    wrapped.scaler.update(new_scale=128.0)
    plugin = ExpertParallelPrecision(wrapped, lambda *a: None)
    checkpoint: dict = {}
    if plugin.state_dict():  # what Lightning's checkpoint connector does, in its order
        checkpoint[type(plugin).__qualname__] = plugin.state_dict()
    plugin.on_save_checkpoint(checkpoint)
    assert list(checkpoint) == ["MixedPrecision"] and checkpoint["MixedPrecision"]["scale"] == 128.0

    restored = ExpertParallelPrecision(MixedPrecision("16-mixed", "cpu"), lambda *a: None)
    restored.on_load_checkpoint(checkpoint)
    assert restored.wrapped.scaler.get_scale() == 128.0


def test_strategy_wraps_the_users_plugin_once() -> None:
    user = HalfPrecision("bf16-true")
    strategy = MoEOverlapStrategy(precision_plugin=user)
    plugin = strategy.precision_plugin
    assert isinstance(plugin, ExpertParallelPrecision) and plugin.wrapped is user
    strategy.precision_plugin = plugin  # Lightning's connector hands the strategy's own plugin back
    assert strategy.precision_plugin is plugin
    other = MoEOverlapStrategy()
    other.precision_plugin = plugin  # another strategy's wrapper: the same user plugin, this strategy's clip
    assert other.precision_plugin.wrapped is user and other.precision_plugin.clip_by_norm == other._clip_grad_by_norm
    assert MoEOverlapStrategy().precision_plugin.precision == "32-true"  # a default until the Trainer sets one
    with pytest.raises(TypeError, match=r"got an `ExpertParallelPrecision` to wrap; pass the plugin it wraps"):
        ExpertParallelPrecision(plugin, lambda *a: None)


def test_trainer_sees_the_wrapped_plugin_and_its_precision() -> None:
    user = MixedPrecision("16-mixed", "cpu")
    trainer = Trainer(accelerator="cpu", devices=2, strategy=MoEOverlapStrategy(ep=2), plugins=[user], logger=False)
    assert trainer.precision_plugin.wrapped is user and trainer.precision == "16-mixed"
