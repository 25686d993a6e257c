"""``ExpertParallelPrecision``: the user's precision plugin, with gradient clipping by the global norm.

Lightning clips through the precision plugin (``gradient_clip_val`` -> ``configure_gradient_clipping`` ->
``trainer.precision_plugin.clip_gradients`` -> ``clip_grad_by_norm``), and a strategy that needs its own clipping
ships its own plugin (``FSDPStrategy`` forces ``FSDPPrecision``, DeepSpeed ``DeepSpeedPrecision``). Here the norm
must be all-reduced over the expert-parallel group (each ep rank holds other experts' gradients), while the plugin
stays the user's choice (``32-true``, ``bf16-mixed``, ``16-mixed``, ``bf16-true`` or one passed in ``plugins``).

So ``MoEOverlapStrategy.precision_plugin`` is this wrapper around the plugin Lightning built. Why a wrapper and
not a subclass of each plugin: the plugin is an instance with state (a ``GradScaler``, a device) built by the
Trainer; a subclass would have to rebuild every plugin type, or swap the instance's class. The wrapper is a plain
``Precision`` that forwards every hook to the wrapped plugin and answers only the norm clip itself:

- ``clip_gradients`` with the ``"norm"`` algorithm clips by the global norm (``grads.clip_grad_norm``); with
  ``"value"`` the wrapped plugin clips (element-wise clipping is the same on every layout);
- the wrapped plugin's own ``optimizer_step`` runs as it is (a ``GradScaler`` unscales before the clip, as always),
  except that with a ``GradScaler`` (``16-mixed``) the overflow flag its ``unscale_`` found is reduced (max) over
  every rank before the step (``agree_found_inf``): each rank checks only its own gradient shards, so without it an
  overflow in one rank's experts would skip the step on that rank alone and the replicas would drift apart. An
  optimizer that unscales inside its own ``step`` (a fused one) is refused under ``16-mixed`` on several ranks;
- its checkpoint state is stored under its own class name (``"MixedPrecision"``), as without this strategy.

``isinstance(trainer.precision_plugin, MixedPrecision)`` is False under this strategy; the wrapped plugin is
``trainer.precision_plugin.wrapped``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_moe_overlap._compat import lightning as pl_compat
from lightning_moe_overlap._compat import torch as torch_compat
from lightning_moe_overlap.parallel.grads import agree_found_inf

ClipByNorm = Callable[[Optimizer, float], None]
AgreeFoundInf = Callable[[Sequence[Tensor]], None]


def _forwarded(name: str) -> Callable[..., Any]:
    """A method that calls the wrapped plugin's method ``name`` with the same arguments."""

    def method(self: ExpertParallelPrecision, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.wrapped, name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"The wrapped plugin's ``{name}``."
    return method


class ExpertParallelPrecision(Precision):
    """Forwards every hook to ``wrapped``; clips by the norm with ``clip_grad_by_norm(optimizer, max_norm)``.

    Args:
        wrapped: the precision plugin Lightning built from ``precision=`` / ``plugins=``.
        clip_grad_by_norm: clips every gradient the optimizer steps by the norm over all ranks.
        agree_found_inf: sets a ``GradScaler``'s found-inf flags to their max over all ranks (collective).
    """

    def __init__(
        self, wrapped: Precision, clip_grad_by_norm: ClipByNorm, agree_found_inf: AgreeFoundInf = agree_found_inf
    ) -> None:
        if isinstance(wrapped, ExpertParallelPrecision):
            raise TypeError(
                "`ExpertParallelPrecision` got an `ExpertParallelPrecision` to wrap; pass the plugin it wraps "
                "(`.wrapped`)."
            )
        self.wrapped = wrapped
        self.precision = wrapped.precision
        self.clip_by_norm = clip_grad_by_norm
        self.agree_found_inf = agree_found_inf

    # -- the clip: the only hook answered here -----------------------------------------------------------------
    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val <= 0:
            return
        if gradient_clip_algorithm != GradClipAlgorithmType.NORM:
            self.wrapped.clip_gradients(optimizer, clip_val, gradient_clip_algorithm)
            return
        if isinstance(self.wrapped, MixedPrecision) and pl_compat.optimizer_handles_unscaling(optimizer):
            raise RuntimeError(
                f"`MoEOverlapStrategy`: `gradient_clip_val={clip_val}` with `{type(optimizer).__qualname__}`, which "
                f"unscales gradients inside its own `step` (a fused optimizer), under `precision="
                f"{self.precision!r}`: the gradients are still scaled when they would be clipped. Use a non-fused "
                "optimizer, or drop `gradient_clip_val`."
            )
        self.clip_grad_by_norm(optimizer, clip_val)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self.clip_by_norm(optimizer, float(clip_val))

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self.wrapped.clip_grad_by_value(optimizer, clip_val)

    # -- the step: with a GradScaler, every rank skips an overflowing step together -------------------------------
    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        scaler = getattr(self.wrapped, "scaler", None)
        if scaler is None or not scaler.is_enabled():
            return self.wrapped.optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if pl_compat.optimizer_handles_unscaling(optimizer) and dist.is_initialized() and dist.get_world_size() > 1:
            raise NotImplementedError(
                f"`MoEOverlapStrategy`: `{type(optimizer).__qualname__}` unscales gradients inside its own `step` (a "
                f"fused optimizer) under `precision={self.precision!r}` on {dist.get_world_size()} ranks: it checks "
                "for overflows on this rank's gradient shards only, so ranks could disagree on skipping a step. "
                "Use a non-fused optimizer (`fused=False`), or `precision='bf16-mixed'` (no loss scaling)."
            )
        with _found_inf_agreed(scaler, self.agree_found_inf):
            return self.wrapped.optimizer_step(optimizer, model=model, closure=closure, **kwargs)

    # -- checkpoints: the wrapped plugin's state under its own class name ------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        """Empty: :meth:`on_save_checkpoint` stores the wrapped plugin's state, under the wrapped class's name."""
        return {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wrapped.load_state_dict(state_dict)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = self.wrapped.state_dict()
        if state:
            checkpoint[type(self.wrapped).__qualname__] = state
        self.wrapped.on_save_checkpoint(checkpoint)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.wrapped.on_load_checkpoint(checkpoint)
        key = type(self.wrapped).__qualname__
        if key in checkpoint:
            self.wrapped.load_state_dict(checkpoint[key])

    # -- every other hook: the wrapped plugin's, as it is -------------------------------------------------------------
    connect = _forwarded("connect")
    convert_module = _forwarded("convert_module")
    tensor_init_context = _forwarded("tensor_init_context")
    module_init_context = _forwarded("module_init_context")
    forward_context = _forwarded("forward_context")
    train_step_context = _forwarded("train_step_context")
    val_step_context = _forwarded("val_step_context")
    test_step_context = _forwarded("test_step_context")
    predict_step_context = _forwarded("predict_step_context")
    convert_input = _forwarded("convert_input")
    convert_output = _forwarded("convert_output")
    pre_backward = _forwarded("pre_backward")
    backward = _forwarded("backward")
    post_backward = _forwarded("post_backward")
    main_params = _forwarded("main_params")
    unscale_gradients = _forwarded("unscale_gradients")
    teardown = _forwarded("teardown")


@contextmanager
def _found_inf_agreed(scaler: Any, agree: AgreeFoundInf) -> Generator[None, None, None]:
    """While open, ``scaler.unscale_(optimizer)`` (called by the plugin, or by ``scaler.step``) ends by passing the
    flags it recorded to ``agree``, so ``scaler.step`` reads the flag of the whole world."""
    unscale = scaler.unscale_

    def unscale_and_agree(optimizer: Optimizer) -> None:
        unscale(optimizer)
        agree(torch_compat.grad_scaler_found_inf(scaler, optimizer))

    scaler.unscale_ = unscale_and_agree
    try:
        yield
    finally:
        del scaler.unscale_  # the class's method again


def with_global_norm_clip(plugin: Precision, clip_grad_by_norm: ClipByNorm) -> ExpertParallelPrecision:
    """``plugin`` wrapped to clip with ``clip_grad_by_norm``; a wrapper that already does is returned as it is, one
    that clips with another function is replaced by a new wrapper of the same plugin."""
    if isinstance(plugin, ExpertParallelPrecision):
        if plugin.clip_by_norm == clip_grad_by_norm:
            return plugin
        plugin = plugin.wrapped
    return ExpertParallelPrecision(plugin, clip_grad_by_norm)
