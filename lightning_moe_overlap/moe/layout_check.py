"""Checks that an adapter's :class:`ExpertsLayout` describes its experts module, before the module is replaced.

Once wrapped, an experts module's own ``forward`` is never called again: the expert-parallel module computes the
experts from the module's tensors with the layout's math alone. So two things are checked at wrap time:

- structure (:func:`check_layout_tensors`): every name of the layout is a tensor of the module; a list of
  per-expert modules (``nn.ModuleList`` of MLPs or ``nn.Linear``) is not an experts module;
- values (:func:`check_layout_math`): on a few tokens, the module's own forward and the layout's math over all
  its experts (:func:`layout_experts_forward`, one process, no communication) agree within a tolerance of the
  module's dtype. Skipped where the module cannot run whole: tensors on the meta device or already sharded
  (``DTensor``), a forward that raises or does not return ``[T, D]``, or a non-finite reference (uninitialised
  weights).

Shape legend:
    T: check tokens   K: top-k   D: hidden size   E: experts   A: kept (token, choice) pairs
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_moe_overlap.moe.grouped import grouped_mlp
from lightning_moe_overlap.moe.experts_layout import ExpertsLayout
from lightning_moe_overlap.moe.permute import gather_rows, scatter_weighted, sort_by_expert

log = logging.getLogger(__name__)

CHECK_TOKENS = 4
CHECK_SEED = 0  # a generator of its own: the check draws nothing from the global RNG
_RTOL = {torch.float64: 1e-9, torch.float16: 1e-2, torch.bfloat16: 4e-2}
_RTOL_FLOAT32 = 1e-4  # float32 matmuls at full precision
_RTOL_REDUCED_FLOAT32 = 2e-2  # float32 matmuls that may run in TF32 or bf16
_RTOL_OTHER = 5e-2


def layout_experts_forward(
    module: nn.Module, layout: ExpertsLayout, hidden_TD: Tensor, indices_TK: Tensor, weights_TK: Tensor
) -> Tensor:
    """``sum_k w_tk * expert_{idx_tk}(x_t)`` as ``layout`` computes it from ``module``'s full weights (all experts,
    one process): the math the expert-parallel module runs, without dispatch. Indices outside ``[0, E)`` are
    dropped choices."""
    up = getattr(module, layout.up_name)
    order_TK, counts_E = sort_by_expert(indices_TK, up.shape[0])
    kept = int(counts_E.sum())  # NOTE: D2H sync (the number of kept rows is a shape)
    assign_A = order_TK[:kept]
    x_AD = gather_rows(hidden_TD, assign_A, indices_TK.shape[-1])
    y_AD = grouped_mlp(
        x_AD,
        counts_E,
        up,
        getattr(module, layout.down_name),
        layout.act_fn,
        transposed=layout.transposed,
        gate_up_bias=getattr(module, layout.up_bias_name) if layout.up_bias_name else None,
        down_bias=getattr(module, layout.down_bias_name) if layout.down_bias_name else None,
        gate_fn=layout.gate_fn,
        gated=layout.gated,
        impl="loop",
    )
    return scatter_weighted(y_AD, assign_A, weights_TK, hidden_TD.shape[0], hidden_TD.dtype)


def _what(name: str, value: object) -> str:
    """How a layout name fails: not an attribute (a dotted path is not looked up), or not a tensor."""
    if value is None:
        dotted = " (a layout names attributes of the module itself; dotted paths are not followed)"
        dotted = dotted if "." in name else ""
        return f"not an attribute of the module{dotted}"
    return f"a {type(value).__name__}, not a tensor"


def check_layout_tensors(name: str, module: nn.Module, adapter: str, layout: ExpertsLayout) -> None:
    """``TypeError`` unless every name of ``layout`` is a tensor of ``module`` (the experts module ``name``), the two
    projections 3-D.

    The error for a list of per-expert modules (``nn.ModuleList`` of MLPs, ``nn.Linear`` per expert) says so: the
    experts must be one module with per-expert tensors whose first dimension is the expert.
    """
    bad = {n: getattr(module, n, None) for n in layout.parameter_names}
    bad = {n: value for n, value in bad.items() if not isinstance(value, Tensor)}
    if not bad:
        _check_weight_dims(name, module, adapter, layout)
        return
    found = ", ".join(f"`{n}` is {_what(n, v)}" for n, v in bad.items())
    lists = isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential)) or any(
        isinstance(v, nn.Module) for v in bad.values()
    )
    why = (
        "a list of per-expert modules (e.g. an `nn.ModuleList` of MLPs or `nn.Linear`s) is not supported. "
        if lists
        else ""
    )
    raise TypeError(
        f"`{name}` ({type(module).__name__}), matched by adapter {adapter!r}: its layout names "
        f"{list(layout.parameter_names)}, but {found}. An experts module must be one module holding per-expert "
        f"tensors whose first dimension is the expert, e.g. `gate_up_proj [E, 2F, D]`, `down_proj [E, D, F]`. "
        f"{why}Stack the experts' weights into 3-D tensors as Hugging Face transformers v5 does, in a module with "
        "forward(hidden_states, top_k_index, top_k_weights), or register an adapter whose layout names such "
        "tensors (docs/adapters.md)."
    )


def _check_weight_dims(name: str, module: nn.Module, adapter: str, layout: ExpertsLayout) -> None:
    flat = {n: tuple(getattr(module, n).shape) for n in (layout.up_name, layout.down_name)}
    flat = {n: shape for n, shape in flat.items() if len(shape) != 3}
    if flat:
        raise TypeError(
            f"`{name}` ({type(module).__name__}), matched by adapter {adapter!r}: the projections {flat} are not 3-D; "
            "the layout's projections must be [E, out, in] (or [E, in, out] with transposed=True) tensors, one "
            "matrix per expert along the first dimension. Store the weights that way (e.g. reshape a 2-D "
            "[E * F, D] weight to [E, F, D]), or register an adapter whose layout names such tensors "
            "(docs/adapters.md)."
        )


def check_layout_math(name: str, module: nn.Module, adapter: str, layout: ExpertsLayout) -> None:
    """``ValueError`` when ``module``'s own forward and ``layout``'s math disagree on a few tokens (module docstring);
    nothing when they agree or the module cannot run whole."""
    tensors = [getattr(module, n) for n in layout.parameter_names]
    up = tensors[0]
    if any(t.is_meta or isinstance(t, DTensor) for t in tensors) or not up.is_floating_point():
        log.debug("%s: layout check skipped (meta, sharded or non-float expert tensors)", name)
        return
    num_experts, dtype, device = up.shape[0], up.dtype, up.device
    generator = torch.Generator().manual_seed(CHECK_SEED)
    indices_TK = check_routing(num_experts, CHECK_TOKENS, min(2, num_experts)).to(device)
    weights_TK = (torch.rand(indices_TK.shape, generator=generator) + 0.5).to(device, dtype)
    with torch.no_grad():
        ran = _own_forward(module, layout, indices_TK, weights_TK, generator)
        if ran is None:
            log.debug("%s: layout check skipped (its forward does not run on [T, D] test tokens)", name)
            return
        hidden_TD, ref_TD = ran
        if not bool(torch.isfinite(ref_TD).all()):  # NOTE: D2H sync (once per block, at wrap time)
            log.debug("%s: layout check skipped (non-finite output: uninitialised weights?)", name)
            return
        try:
            ours_TD = layout_experts_forward(module, layout, hidden_TD, indices_TK, weights_TK)
        except Exception as err:  # noqa: BLE001 - any failure of the layout's math is a wrong layout
            failed = f"its layout's math fails on them ({err})"
            raise ValueError(_mismatch(name, module, adapter, layout, failed)) from err
    diff = torch.nan_to_num((ours_TD.double() - ref_TD.double()).abs(), nan=float("inf")).max().item()
    tol = _rtol(dtype, device) * ref_TD.double().abs().max().item()
    if not diff <= tol:
        what = f"max abs difference {diff:.3g} > tolerance {tol:.3g} ({dtype})"
        raise ValueError(_mismatch(name, module, adapter, layout, what))


def check_routing(num_experts: int, num_tokens: int, top_k: int) -> Tensor:
    """``[T, K]`` int64 expert ids reaching as many experts as ``T * K`` choices afford, spread over ``[0, E)``,
    distinct within a token."""
    slots = torch.arange(num_tokens * top_k)
    if num_experts >= slots.numel():
        return (slots * num_experts // slots.numel()).view(num_tokens, top_k)
    return (slots % num_experts).view(num_tokens, top_k)


def _own_forward(
    module: nn.Module, layout: ExpertsLayout, indices_TK: Tensor, weights_TK: Tensor, generator: torch.Generator
) -> tuple[Tensor, Tensor] | None:
    """``(hidden_TD, module.forward(hidden_TD, ...))`` for the first hidden size the module runs with, or ``None``.

    The hidden size is tried from the layout first, then from the other orientation of the weights: a wrong
    ``transposed`` flag then shows as a mismatch, not as a skipped check. ``forward`` is called directly: the
    module's hooks (e.g. token counters) do not see the test tokens.
    """
    up, down = getattr(module, layout.up_name), getattr(module, layout.down_name)
    candidates = [up.shape[1], up.shape[2]] if layout.transposed else [up.shape[2], up.shape[1]]
    candidates += [down.shape[1], down.shape[2]]
    for hidden in dict.fromkeys(candidates):
        hidden_TD = torch.randn(indices_TK.shape[0], hidden, generator=generator).to(up.device, up.dtype)
        try:
            out = module.forward(hidden_TD, indices_TK, weights_TK)
        except Exception as err:  # noqa: BLE001 - a module that cannot run whole is not checked
            log.debug("layout check: %s.forward with hidden size %d raised %r", type(module).__name__, hidden, err)
            continue
        if isinstance(out, Tensor) and out.shape == hidden_TD.shape:
            return hidden_TD, out
    return None


def _rtol(dtype: torch.dtype, device: torch.device) -> float:
    """Relative to the largest output: float32 matmuls may run in TF32 / bf16 on accelerators, or when allowed."""
    if dtype == torch.float32:
        full = device.type == "cpu" and torch.get_float32_matmul_precision() == "highest"
        return _RTOL_FLOAT32 if full else _RTOL_REDUCED_FLOAT32
    return _RTOL.get(dtype, _RTOL_OTHER)


def _mismatch(name: str, module: nn.Module, adapter: str, layout: ExpertsLayout, what: str) -> str:
    return (
        f"`apply_expert_parallel`: the experts module `{name}` ({type(module).__name__}), matched by adapter "
        f"{adapter!r}, and its layout disagree on {CHECK_TOKENS} test tokens: {what}. After wrapping, only the "
        "layout's math runs (the module's own forward is no longer called), so it must compute what the forward "
        "does. Check the adapter's ExpertsLayout fields: act_fn, transposed ([E, in, out] vs [E, out, in]), gated, "
        f"gate_fn, up_name/down_name (and the bias names); got {layout}."
    )
