"""``apply_fp8(model, recipe)``: the one entry point that puts a model's GEMMs in FP8 (docs/fp8.md).

It converts, in place:

- the dense linears, through torchao (:mod:`.dense`, its float8 linear, or its MX linear for ``mxfp8``; output heads
  and routers left out by default);
- the routed experts, this package's :class:`~lightning_moe_overlap.moe.experts.Experts` and
  :class:`~lightning_moe_overlap.moe.ep.ExpertParallelExperts` (any experts module the strategy wrapped, HF ones
  included), by setting their ``kernel`` to the FP8 kernel (:mod:`.experts_kernel`). An ``Experts`` converted before the
  strategy wraps it passes its kernel on to its wrapper; an HF experts module is converted once wrapped.

Parameters, buffers and state-dict keys do not change: the weights stay the high-precision masters, quantised when
each GEMM runs. Everything left out is in the returned report with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_moe_overlap.fp8.dense import (
    LinearFilter,
    convert_linears,
    default_linear_filter,
    linear_align,
    plan_linears,
)
from lightning_moe_overlap.fp8.experts_kernel import Float8ExpertsKernel
from lightning_moe_overlap.float8.gemm import OUT_DTYPES
from lightning_moe_overlap.float8.recipes import Float8Recipe, resolve_recipe
from lightning_moe_overlap.moe.ep import ExpertParallelExperts
from lightning_moe_overlap.moe.experts import Experts
from lightning_moe_overlap.parallel.dtensors import local

MIN_CUDA_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada, Hopper and later


@dataclass(frozen=True)
class Float8Report:
    """What :func:`apply_fp8` converted and what it left out.

    Attributes:
        recipe: the recipe in effect.
        linears: FQNs of the dense linears now in FP8 (torchao's ``Float8Linear``).
        experts: FQNs of the experts modules whose projections now run in FP8.
        skipped: FQN -> why that linear or experts module stays in high precision.
        float8_all_gather: the linears' weights are all-gathered in float8 by ``fully_shard``.
    """

    recipe: Float8Recipe
    linears: tuple[str, ...] = ()
    experts: tuple[str, ...] = ()
    skipped: dict[str, str] = field(default_factory=dict)
    float8_all_gather: bool = False

    def __str__(self) -> str:
        lines = [f"FP8 {self.recipe.name}: {len(self.linears)} linears, {len(self.experts)} experts modules"]
        if self.float8_all_gather:
            lines[0] += ", weights all-gathered in float8"
        lines += [f"  kept in high precision: {fqn or '<root>'}: {why}" for fqn, why in self.skipped.items()]
        return "\n".join(lines)


def apply_fp8(
    model: nn.Module,
    recipe: str | Float8Recipe = "tensorwise",
    *,
    dense: bool = True,
    experts: bool = True,
    module_filter: LinearFilter = default_linear_filter,
    device: torch.device | str | None = None,
    float8_all_gather: bool = False,
) -> Float8Report:
    """Run ``model``'s dense linears and routed experts in FP8 with ``recipe`` (``"tensorwise"``, ``"rowwise"`` or
    ``"mxfp8"``).

    Args:
        model: converted in place.
        recipe: a name from :data:`~lightning_moe_overlap.float8.recipes.RECIPES` or a :class:`Float8Recipe`.
        dense: convert the dense ``nn.Linear`` modules (needs torchao, the ``fp8`` extra).
        experts: convert the routed experts.
        module_filter: ``(fqn, linear) -> bool``, which dense linears may convert (default: all but output heads and
            routers); a linear whose dims are not multiples of 16 (32 with ``mxfp8``) stays in high precision
            whatever it says.
        device: where the model will train (default: its parameters' device).
        float8_all_gather: ``tensorwise`` only: the dense linears' weights are cast to float8 before
            ``fully_shard``'s all-gather (torchao's ``enable_fsdp_float8_all_gather``); call
            :func:`~lightning_moe_overlap.fp8.dense.precompute_float8_scales` after each optimizer step.

    Returns:
        The :class:`Float8Report`.

    Raises:
        ValueError: an unknown recipe; ``float8_all_gather`` with a recipe other than ``tensorwise``.
        NotImplementedError: a recipe that needs Transformer Engine; a CUDA GPU without FP8; experts on the
            Transformer Engine backend; ``mxfp8`` on tensor-parallel linears.
        TypeError: experts whose weights are not float32, bfloat16 or float16.
        ImportError: ``dense=True`` without torchao.
    """
    where = _training_device(model, device)
    recipe = resolve_recipe(recipe, where)
    _check_device(where)
    align = linear_align(recipe)
    planned, skipped = plan_linears(model, module_filter, align=align) if dense else ([], {})
    found = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, (Experts, ExpertParallelExperts))]
    kernel = Float8ExpertsKernel(recipe)
    converted_experts = []
    for fqn, module in found if experts else ():
        reason = _experts_refusal(fqn, module, align)
        if reason:
            skipped[fqn] = reason
        else:
            converted_experts.append((fqn, module))
    if experts:
        skipped.update(_unwrapped_experts(model))
    linears: tuple[str, ...] = ()
    if planned:
        linears, skipped_dense = convert_linears(model, recipe, module_filter, float8_all_gather=float8_all_gather)
        skipped.update(skipped_dense)
    for _, module in converted_experts:
        module.kernel = kernel
    experts_fqns = tuple(fqn for fqn, _ in converted_experts)
    return Float8Report(recipe, linears, experts_fqns, skipped, float8_all_gather=float8_all_gather and bool(linears))


def _training_device(model: nn.Module, device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    first = next(model.parameters(), None)
    return torch.device("cpu") if first is None else first.device


def _check_device(device: torch.device) -> None:
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CUDA_CAPABILITY:
        raise NotImplementedError(
            f"`apply_fp8`: the GPU {device} has compute capability {capability}, but FP8 GEMMs need "
            f"{MIN_CUDA_CAPABILITY} or newer (Ada, Hopper, Blackwell). Train in bf16 on this GPU, or on a newer one."
        )


def _experts_refusal(fqn: str, module: nn.Module, align: int) -> str | None:
    """Why an experts module cannot run in FP8 (a dims reason to report), or None; raises for what must not pass."""
    if getattr(module, "expert_backend", "torch") == "te":
        raise NotImplementedError(
            f"`apply_fp8`: the experts {fqn!r} run on `expert_backend='te'`, whose FP8 (Transformer Engine's own "
            "recipes) is not wired here yet. Use `expert_backend='torch'` for FP8 experts."
        )
    weights = [local(p) for p in module.parameters(recurse=False) if p.dim() == 3]
    wrong = sorted({str(w.dtype) for w in weights if w.dtype not in OUT_DTYPES})
    if wrong:
        raise TypeError(
            f"`apply_fp8`: the experts {fqn!r} hold {wrong} weights; FP8 GEMMs quantise float32, bfloat16 or float16 "
            "masters. Convert the model to one of those dtypes first."
        )
    dims = sorted({d for w in weights for d in w.shape[1:]})
    if any(d % align for d in dims):
        return f"expert weight dims {dims}: FP8 GEMMs need multiples of {align}"
    return None


def _unwrapped_experts(model: nn.Module) -> dict[str, str]:
    """The experts modules of other kinds (Hugging Face's, a registered adapter's) that are not expert-parallel yet:
    they take the FP8 kernel only once wrapped. Those on the meta device (another pipeline rank's chunk) are left
    out of the report."""
    from lightning_moe_overlap.moe.adapters import find_experts  # it imports the dispatchers, which import fp8

    return {
        name: (
            "experts module of another kind (a Hugging Face one): it runs in FP8 once made expert-parallel; call "
            "`apply_expert_parallel` first, as `MoEOverlapStrategy(fp8=...)` does"
        )
        for name, found in find_experts(model).items()
        if not isinstance(found.module, Experts) and not any(p.is_meta for p in found.module.parameters())
    }


def has_fp8_kernel(module: nn.Module) -> bool:
    """Whether an experts module runs its projections in FP8."""
    return isinstance(getattr(module, "kernel", None), Float8ExpertsKernel)

