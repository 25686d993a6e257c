"""The stages of the experts as modules: where hooks, checkpoints and saved-tensor hooks attach.

:class:`~lightning_moe_overlap.moe.ep.ExpertParallelExperts` runs its expert MLP (between dispatch and combine)
as four module calls, reached with ``experts.stage(name)``:

- ``local``, called with ``(x_RD, splits)`` (the dispatch's ``RowSplits``): the whole expert MLP, i.e. the three
  below;
- ``fc1``, ``(x_RD, splits)``: the first projection (fused gate/up) and its per-expert bias;
- ``act``, ``(h_RF2,)``: the activation (``act(gate) * up``, the layout's own gate, or ``act`` alone);
- ``fc2``, ``(h_RF, splits)``: the down projection and its per-expert bias.

(``splits`` is the :class:`~lightning_moe_overlap.moe.grouped.RowSplits` of the call, shared by all stages.)

The shared experts of a block whose shared-expert forward runs in the dispatch window (``moe/shared.py``) have a
stage too, ``block.shared_stage`` (name ``"shared"``, called with the block's ``(x,)``): the window runs the shared
experts through it, once per block call, wherever that computation lands.

Because each stage is a module call, the supported extension points of ``nn.Module`` apply to it:
``register_forward_pre_hook`` / ``register_forward_hook`` see its inputs and output, a
``torch.autograd.graph.saved_tensors_hooks`` context entered in a pre-hook and left in the forward hook covers
exactly the tensors it saves, and ``torch.utils.checkpoint.checkpoint(stage, *args, use_reentrant=False)`` runs it.

A stage holds the computation, not the weights: it runs a method of the experts module, whose parameters keep
their names and state-dict keys; a stage has no parameters or buffers.

Wrappers: ``stage.add_wrapper(wrap)`` makes the stage run ``wrap(compute)(*args)`` (a checkpoint of the stage, for
instance) inside its hooks; the first wrapper added is the innermost. The returned handle removes the wrapper, in
any order. This is how ``SelectiveRecompute`` checkpoints ``local`` and ``act`` (docs/memory.md).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

STAGE_NAMES: tuple[str, ...] = ("local", "fc1", "act", "fc2")
SHARED_STAGE = "shared"

Compute = Callable[..., Tensor]
Wrapper = Callable[[Compute], Compute]


class ExpertsStage(nn.Module):
    """One named stage of the local experts, or the shared experts' stage (see the module docstring).

    Args:
        name: the stage's name (one of :data:`STAGE_NAMES`, or :data:`SHARED_STAGE`).
        compute: what the stage computes, a method of the module that owns the weights.
    """

    def __init__(self, name: str, compute: Compute) -> None:
        super().__init__()
        self.name = name
        self.compute = compute
        self._wrappers: OrderedDict[int, Wrapper] = OrderedDict()  # a handle holds it by weak reference

    def add_wrapper(self, wrap: Wrapper) -> RemovableHandle:
        """Run the stage's computation as ``wrap(compute)`` (innermost first); ``handle.remove()`` undoes it."""
        handle = RemovableHandle(self._wrappers)
        self._wrappers[handle.id] = wrap
        return handle

    @property
    def wrapped(self) -> bool:
        """Whether a wrapper is installed."""
        return bool(self._wrappers)

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        fn = self.compute
        for wrap in self._wrappers.values():
            fn = wrap(fn)
        return fn(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"{self.name!r}" + (f", wrappers={len(self._wrappers)}" if self._wrappers else "")
