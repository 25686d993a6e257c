"""Shared experts of Hugging Face MoE blocks inside the dispatch window (``shared_expert_overlap``).

Megatron's ``moe_shared_expert_overlap`` computes the shared experts between issuing the dispatch all-to-all and
waiting on it. This package's ``MoELayer`` does it itself (it submits the shared-expert forward to the comm
runtime); HF v5 blocks call their shared experts inline, in one of two orders:

- before the routed experts (Qwen2-MoE: ``shared_expert_output = self.shared_expert(x)`` first): the call returns a
  placeholder of the right shape and dtype (probed on zero rows) and the real forward is submitted to the runtime;
  it runs at the routed experts' token dispatch (the first comm point that moves tokens: metadata exchanges leave
  side work queued, in the submitting context's own queue, ``overlap/pending.py``) and copies into the
  placeholder, which the block only reads after the routed experts returned;
- after them (DeepSeek-V3: ``self.shared_experts(residuals)`` last): when the routed experts start, the shared
  forward on the block's input is submitted; the later call with that input returns its result.

Either way the same operations run on the same inputs (the copy is exact and its backward the identity), so the
results are bitwise equal to the inline block. When the routed experts had no comm point, the work runs right
after them. Per-call state is thread-local: the two contexts of a schedule never share it.

The shared stage: the real computation always runs as one call of an explicit stage module,
``block.shared_stage`` (an :class:`~lightning_moe_overlap.moe.stages.ExpertsStage` named ``"shared"`` that runs
the shared experts' own forward; no parameters of its own, so the state-dict keys do not change). Forward hooks,
``add_wrapper`` and ``torch.utils.checkpoint`` attach to it and see the real input and output once per block call,
wherever the computation runs (inside the dispatch window, or inline). The block's own call of its shared experts
module is redirected with that module's forward hooks, the supported extension point (nothing of the module is
replaced): a pre-hook keeps the call's arguments and hands the module's forward zero rows of them (what the
placeholder's shape and dtype are probed with), and a forward hook returns the stage's result, the window's
result, or the placeholder instead of that empty output. Hooks registered on the shared-experts module itself
therefore see the zero rows, not the computation. :func:`shared_stage` returns the module to attach to, with or
without a window.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import Tensor, nn

from lightning_moe_overlap.moe.stages import SHARED_STAGE, ExpertsStage
from lightning_moe_overlap.overlap.pending import SideWork
from lightning_moe_overlap.overlap.runtime import CommRuntime

SHARED_NAMES = ("shared_experts", "shared_expert")  # DeepSeek-V2/V3, Dots1, ... / Qwen2-MoE
STAGE_ATTR = "shared_stage"  # the window's stage, a child of the block


class _CallState:
    """One block call: its input, whether the routed experts ran, the submitted shared work, and the arguments of
    the shared-experts call in progress."""

    def __init__(self, block_input: Tensor | None) -> None:
        self.block_input = block_input
        self.experts_started = False
        self.shared_called = False
        self.work: SideWork | None = None
        self.cancelled = False
        self.call: tuple[tuple[Any, ...], dict[str, Any]] | None = None  # the redirected call's (args, kwargs)


class SharedExpertWindow:
    """Runs one HF block's shared experts inside its routed experts' dispatch window (module docstring).

    Args:
        block: the MoE block (parent of ``experts`` and the shared experts).
        shared_name: the shared experts' attribute on ``block``.
        runtime: the comm runtime the routed experts' comm points call ``handoff`` on.
    """

    def __init__(self, block: nn.Module, shared_name: str, runtime: CommRuntime) -> None:
        self.block = block
        self.shared: nn.Module = getattr(block, shared_name)
        self.runtime = runtime
        self.stage = ExpertsStage(SHARED_STAGE, self.shared.forward)  # every real computation is one call of it
        block.add_module(STAGE_ATTR, self.stage)
        self._local = threading.local()
        experts = block.experts
        self._handles = [
            block.register_forward_pre_hook(self._block_started),
            block.register_forward_hook(self._block_finished),
            experts.register_forward_pre_hook(self._experts_started),
            experts.register_forward_hook(self._experts_finished),
            self.shared.register_forward_pre_hook(self._shared_called, with_kwargs=True, prepend=True),
            self.shared.register_forward_hook(self._shared_returned, with_kwargs=True, prepend=True),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        delattr(self.block, STAGE_ATTR)

    # -- the block's and the routed experts' hooks ------------------------------------------------------------------
    def _state(self) -> _CallState | None:
        return getattr(self._local, "call", None)

    def _block_started(self, module: nn.Module, args: Any) -> None:
        first = args[0] if args and isinstance(args[0], Tensor) else None
        self._local.call = _CallState(first)

    def _block_finished(self, module: nn.Module, args: Any, output: Any) -> None:
        state = self._state()
        if state is not None and state.work is not None and not state.shared_called:
            state.cancelled = True  # the block did not call its shared experts with its input: drop the work
        self._local.call = None

    def _experts_started(self, module: nn.Module, args: Any) -> None:
        state = self._state()
        if state is None or state.experts_started:
            return
        state.experts_started = True
        if not state.shared_called and state.block_input is not None:
            x = state.block_input
            state.work = self.runtime.submit(lambda: None if state.cancelled else self.stage(x))

    def _experts_finished(self, module: nn.Module, args: Any, output: Any) -> None:
        state = self._state()
        if state is not None and state.work is not None and state.shared_called:
            state.work.run()  # no comm point ran it: fill the placeholder before the block reads it

    # -- the shared experts' call: its arguments kept, its forward run on zero rows, its output replaced ------------
    def _shared_called(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        state = self._state()
        if state is None or not args or not isinstance(args[0], Tensor) or state.call is not None:
            return None  # outside a block call (or nested): the module runs as written
        state.call = (args, kwargs)
        x = args[0]
        return (x.reshape(-1, x.shape[-1])[:0], *args[1:]), kwargs

    def _shared_returned(self, module: nn.Module, args: tuple, kwargs: dict, empty: Any) -> Tensor | None:
        state = self._state()
        if state is None or state.call is None:
            return None
        (x, *rest), call_kwargs = state.call
        state.call = None
        if rest or call_kwargs or state.shared_called:
            return self.stage(x, *rest, **call_kwargs)
        state.shared_called = True
        if state.experts_started:  # called after the routed experts (DeepSeek-V3 order)
            if state.work is not None and x is state.block_input:
                return state.work.result()
            return self.stage(x)
        # Called before the routed experts (Qwen2-MoE order): a placeholder now, the forward in the window. The
        # forward just ran on zero rows (the pre-hook's), which gives the output's width and dtype.
        out = torch.empty(*x.shape[:-1], empty.shape[-1], dtype=empty.dtype, device=empty.device)
        state.work = self.runtime.submit(lambda: out.copy_(self.stage(x)))
        return out


def shared_stage(block: nn.Module) -> nn.Module | None:
    """The module whose call is the computation of ``block``'s shared experts, where hooks and checkpoints attach:
    the window's stage when they run in the dispatch window (``block.shared_stage``), else the shared-experts
    module itself (this package's ``MoELayer`` calls it as it is, in the window or inline). ``None`` without shared
    experts."""
    stage = getattr(block, STAGE_ATTR, None)
    if isinstance(stage, ExpertsStage):
        return stage
    return next((m for m in (getattr(block, n, None) for n in SHARED_NAMES) if isinstance(m, nn.Module)), None)


def overlap_shared_experts(block: nn.Module, runtime: CommRuntime) -> SharedExpertWindow | None:
    """Install a :class:`SharedExpertWindow` on ``block`` when it has shared experts; ``None`` otherwise."""
    for name in SHARED_NAMES:
        if isinstance(getattr(block, name, None), nn.Module) and isinstance(getattr(block, "experts", None), nn.Module):
            return SharedExpertWindow(block, name, runtime)
    return None
