"""The experts' GEMMs on Transformer Engine: ``transformer_engine.pytorch.GroupedLinear`` with delayed wgrad.

Selected with ``MoEOverlapStrategy(expert_backend="te")`` (default ``"torch"``: :mod:`~lightning_moe_overlap.moe.grouped`).
TE is imported lazily, on the first forward; the CPU path never needs it.

Weights stay where they are. The experts keep this package's 3-D parameters (``[e, O, I]``), which the optimizer,
gradient sync and checkpoints see; TE's module is not registered as a submodule, so ``state_dict`` and
``parameters()`` do not change. The mapping: TE's ``weight{i}`` (``[O, I]``, as ``nn.Linear``) is a view of
expert ``i``'s slice ``weight[i]`` (same memory, so optimizer steps and checkpoint loads are seen at once; it
is re-bound when the parameter's memory, dtype or device changes, e.g. after ``model.to(device)``).

Weight gradients: TE is built with ``delay_wgrad_compute=True``, so its backward computes the data gradient only
and keeps the weight-gradient GEMMs for ``backward_dw()``. A hook on TE's autograd node passes a closure to
``runtime.defer_wgrad`` (run at the next comm point, while an all-to-all is in flight) or runs it at once; it calls
``backward_dw()``, which sets each ``weight{i}.grad``, stacks them, casts to the parameter's dtype and
accumulates into the 3-D parameter's ``.grad``. TE's queue and the runtime's are both first in, first out and are
filled together, so each closure pops its own backward's GEMMs.

Limits: weights stored ``[e, out, in]`` (not ``transposed``) and no per-expert biases (Qwen3-MoE, Mixtral,
OLMoE, DeepSeek-V3, this package's ``Experts``); other layouts raise ``NotImplementedError`` at wrap time. TE
takes the rows per expert as a host list (``m_splits``), so a device counts tensor is read back once per call.

Shape legend:
    R: rows sorted by expert   e: local experts   D: hidden size   F: expert ffn size   I, O: in/out size
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn

from lightning_moe_overlap._install import install_hint
from lightning_moe_overlap.config import EXPERT_BACKENDS, ExpertBackend
from lightning_moe_overlap.moe.experts_layout import ExpertsLayout
from lightning_moe_overlap.overlap.runtime import CommRuntime
from lightning_moe_overlap.parallel.dtensors import like, local

__all__ = ["EXPERT_BACKENDS", "ExpertBackend", "TEExperts", "TEProjection", "check_te_layout", "import_te"]

TE_INSTALL_HINT = install_hint("te")


_OWNER = "`expert_backend='te'`"


def te_available() -> bool:
    """Whether ``transformer_engine`` is importable (without importing it)."""
    return importlib.util.find_spec("transformer_engine") is not None


def import_te(owner: str = "`expert_backend='te'`") -> ModuleType:
    """``transformer_engine.pytorch``, or ``ImportError`` with the install hint."""
    try:
        import transformer_engine.pytorch as te  # noqa: PLC0415 - optional backend, imported lazily
    except ImportError as err:
        raise ImportError(
            f"{owner} needs NVIDIA Transformer Engine (`transformer_engine.pytorch`), which is not installed. "
            f"Install it with {TE_INSTALL_HINT} on a CUDA machine, or use `expert_backend='torch'` (pure "
            "PyTorch grouped GEMMs, runs everywhere)."
        ) from err
    return te


def check_te_layout(layout: ExpertsLayout, owner: str) -> None:
    """``NotImplementedError`` for layouts the TE backend does not map (transposed weights, per-expert biases)."""
    unsupported = []
    if layout.transposed:
        unsupported.append("weights stored [e, in, out] (transposed)")
    if layout.up_bias_name or layout.down_bias_name:
        unsupported.append("per-expert biases")
    if unsupported:
        raise NotImplementedError(
            f"{owner}: `expert_backend='te'` maps [e, out, in] weights without biases onto TE's GroupedLinear, but "
            f"these experts have {' and '.join(unsupported)}. Use `expert_backend='torch'` for this model."
        )


class TEProjection:
    """One projection of the experts (``[e, O, I]`` parameter) run by a TE ``GroupedLinear`` bound to its memory.

    Args:
        weight: the experts' 3-D parameter; it stays the one the optimizer and checkpoints see (a ``DTensor``
            over the ep mesh: TE runs on its local shard and the gradient is given back in the same form).
        te_module: ``transformer_engine.pytorch`` (or a stand-in with the same ``GroupedLinear``); None imports TE.
    """

    def __init__(self, weight: nn.Parameter, te_module: ModuleType | None = None) -> None:
        self.weight = weight
        self._te = te_module
        self._linear: Any = None
        self._bound: tuple[int, torch.dtype, torch.device] | None = None
        self._linear_dtype: torch.dtype | None = None
        self._queued = 0  # backwards whose weight-gradient work TE holds for `backward_dw`

    def linear(self) -> Any:
        """The TE module, bound to the parameter's current memory.

        Built once, on the meta device (no allocation, no draw from the CUDA generator), then its weights are made
        views of the parameter's memory; when that memory changes (FSDP frees and gathers it around every step)
        the same module is bound again."""
        w = local(self.weight).detach()
        key = (w.data_ptr(), w.dtype, w.device)
        if self._linear is None or self._linear_dtype != w.dtype:
            te = self._te if self._te is not None else import_te()
            num_gemms, out_features, in_features = w.shape
            self._linear = te.GroupedLinear(
                num_gemms, in_features, out_features, bias=False, params_dtype=w.dtype, device="meta",
                delay_wgrad_compute=True,
            )
            self._linear_dtype, self._bound = w.dtype, None
        if self._bound != key:
            if getattr(self._linear, "single_grouped_parameter", False):  # one [e, out, in] parameter: ours as is
                _bind(self._linear, "weight", w.data)
            else:
                for i in range(w.shape[0]):  # weight{i} is expert i's slice: same memory, TE's [out, in] layout
                    _bind(self._linear, f"weight{i}", w.data[i])
            self._bound = key
        return self._linear

    def __call__(self, x_RI: Tensor, sizes: Sequence[int], runtime: CommRuntime | None) -> Tensor:
        linear = self.linear()
        y_RO = linear(x_RI, list(sizes))
        node = y_RO.grad_fn
        if node is not None:
            node.register_hook(lambda grad_inputs, grad_outputs: self._after_backward(linear, runtime))
        return y_RO

    def _after_backward(self, linear: Any, runtime: CommRuntime | None) -> None:
        self._queued += 1  # TE's backward queued this one's weight-gradient work

        def finish() -> None:
            self.finish_wgrad(linear)

        if runtime is None or not runtime.defer_wgrad(finish):
            finish()

    @torch.no_grad()
    def finish_wgrad(self, linear: Any) -> None:
        """Run TE's delayed weight-gradient GEMMs and accumulate them into the 3-D parameter's ``.grad``.

        Raises:
            RuntimeError: no backward of this projection is waiting for its weight gradient, or TE's
                ``backward_dw`` set none (it returns silently on an empty queue: the gradient would be zeros).
        """
        if self._queued == 0:
            raise RuntimeError(
                f"{_OWNER}: a weight-gradient run of the experts' {tuple(local(self.weight).shape)} projection was "
                "asked for with no backward of it waiting: TE's `backward_dw` would run on an empty queue and leave "
                "zeros. Each backward through the projection queues one run; report this with the schedule used."
            )
        self._queued -= 1
        linear.backward_dw()
        if getattr(linear, "single_grouped_parameter", False):
            grads = [linear.weight.grad]
            linear.weight.grad = None
        else:
            grads = []
            for i in range(local(self.weight).shape[0]):
                w_i = getattr(linear, f"weight{i}")
                grads.append(w_i.grad)  # (set, not added, by TE)
                w_i.grad = None
        if any(g is None for g in grads):
            raise RuntimeError(
                f"{_OWNER}: TE's `backward_dw` set no weight gradient for the experts' "
                f"{tuple(local(self.weight).shape)} projection although a backward of it was queued: its queue and "
                "this backend's disagree, and the gradient would be zeros. Check that nothing else calls "
                "`backward_dw` on these modules."
            )
        dw = (grads[0] if len(grads) == 1 and grads[0].dim() == 3 else torch.stack(grads)).to(self.weight.dtype)
        if self.weight.grad is None:
            self.weight.grad = like(self.weight, dw)
        else:
            local(self.weight.grad).add_(dw)


def _bind(linear: nn.Module, name: str, memory: Tensor) -> None:
    """Make ``linear``'s parameter ``name`` a view of ``memory``: the meta one it was built with is replaced (a meta
    tensor cannot take another device's data), a bound one takes the new memory."""
    current = getattr(linear, name)
    if current.device == memory.device:
        current.data = memory
    else:
        setattr(linear, name, nn.Parameter(memory, requires_grad=current.requires_grad))


class TEExperts:
    """The two projections of an experts module on TE (a plain object: nothing registered on the module).

    The experts' ``fc1`` and ``fc2`` stages call ``gate_up`` and ``down``; the activation between them is the
    torch backend's (:func:`~lightning_moe_overlap.moe.grouped.expert_activation`).
    """

    def __init__(self, gate_up: nn.Parameter, down: nn.Parameter, te_module: ModuleType | None = None) -> None:
        self.gate_up = TEProjection(gate_up, te_module)
        self.down = TEProjection(down, te_module)
