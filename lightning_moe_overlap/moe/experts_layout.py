"""How an experts module stores its 3-D weights and computes one expert: what sharding and compute need to know.

The default layout is Hugging Face v5's: ``gate_up_proj [E, 2F, D]`` with the gate rows first, ``down_proj
[E, D, F]``, no biases, ``down(act(gate) * up)``. Other HF models differ, and their experts classes say how
through the flags of ``transformers.integrations.moe.use_experts_implementation`` (``is_transposed``,
``has_bias``, ``has_gate``, ``is_concatenated``) and an optional ``_apply_gate`` override; adapters translate
those into an :class:`ExpertsLayout`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn


@dataclass(frozen=True)
class ExpertsLayout:
    """The storage and math of one experts module.

    Attributes:
        act_fn: element-wise activation (``None`` when ``gate_fn`` does all of it).
        up_name: attribute of the first projection: ``[E, 2F, D]`` fused gate/up (or ``[E, F, D]`` with
            ``gated=False``).
        down_name: attribute of the down projection ``[E, D, F]``.
        up_bias_name: attribute of an ``[E, 2F]`` bias of the first projection, if any.
        down_bias_name: attribute of an ``[E, D]`` bias of the down projection, if any.
        transposed: weights stored ``[E, in, out]`` (``x @ W``) instead of ``[E, out, in]`` (``x @ W.T``).
        gated: the first projection is a fused gate/up pair.
        gate_fn: replaces the default ``act(gate) * up`` on the first projection's output (interleaved or clamped
            gates); must hold no reference to the full expert weights.
    """

    act_fn: Callable[[Tensor], Tensor] | None
    up_name: str = "gate_up_proj"
    down_name: str = "down_proj"
    up_bias_name: str | None = None
    down_bias_name: str | None = None
    transposed: bool = False
    gated: bool = True
    gate_fn: Callable[[Tensor], Tensor] | None = None

    @property
    def parameter_names(self) -> tuple[str, ...]:
        """The per-expert tensors to shard, first dimension = expert."""
        names = (self.up_name, self.down_name, self.up_bias_name, self.down_bias_name)
        return tuple(name for name in names if name is not None)


def method_without_weights(module: nn.Module, method: str) -> Callable[[Tensor], Tensor]:
    """``module.<method>`` bound to a shallow copy of ``module`` that holds no parameters or buffers.

    Used for gate functions defined as methods of an experts class (they read attributes such as ``act_fn``,
    ``alpha`` or ``limit``): the bound copy keeps those, but not the full expert weights, so sharding still
    frees them.
    """
    shell = copy.copy(module)
    shell.__dict__["_parameters"] = {}
    shell.__dict__["_buffers"] = {}
    return getattr(shell, method)
