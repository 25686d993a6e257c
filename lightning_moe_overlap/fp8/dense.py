"""Dense linears in FP8 through torchao's float8 training (``convert_to_float8_training``), on CPU and CUDA.

torchao swaps each chosen ``nn.Linear`` for its ``Float8Linear`` (a subclass of ``nn.Linear`` whose weight stays the
same high-precision parameter: names, state-dict keys and optimizer state do not change) and runs its three GEMMs
through ``torch._scaled_mm`` with the recipe's current scaling. The recipes are torchao's own by name
(``Float8LinearConfig.from_recipe_name``): ``tensorwise`` and ``rowwise`` (:mod:`.recipes`). With ``mxfp8`` each
chosen linear becomes torchao's MX linear instead (:class:`~lightning_moe_overlap.fp8.mx_linear.MXLinear`, blocks of
32 with e8m0 scales, emulated kernels).

Which linears: every ``nn.Linear`` that passes ``module_filter(fqn, module)`` and whose in and out features are
multiples of 16 (the FP8 kernels' rule on CUDA; kept on CPU too, so a model converts the same way everywhere), of 32
with ``mxfp8`` (whole blocks along both contraction dims: the in features forward, the out features backward). The
default filter (:func:`default_linear_filter`) leaves out the output head and the routers, whose numerics matter
more than their share of the FLOPs (torchtitan leaves its output layer out by default too). Every linear left out
is reported with the reason.

Under a tensor-parallel plan (``tp > 1``, ``parallelize/tensor_plan.py``), which the strategy applies before this
conversion: each planned linear holds its ``DTensor`` shard, and its ``Float8Linear`` holds the same one and gets the same
style again (:class:`~lightning_moe_overlap.parallel.tp_styles.PlannedLinear`): the GEMMs run in FP8 on each rank's
shard, and the plan's collectives stay in the training dtype (torchao's FP8 parallel styles, which all-gather in
FP8, are not used: docs/fp8.md). A linear whose weight its model uses outside the linear's forward says so with
:data:`HIGH_PRECISION_ATTR` (the reason) and stays in high precision (``MoEGPT``'s fused ``qkv`` at ``tp > 1``).
``mxfp8`` does not take a tensor-parallel plan (its linears would be refused here; the strategy's rule refuses
``tp > 1`` first).

torchao is optional (the ``fp8`` extra) and imported on the first conversion.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import ModuleType

from torch import nn

from lightning_moe_overlap._install import install_hint
from lightning_moe_overlap.float8.recipes import RECIPES, Float8Recipe
from lightning_moe_overlap.parallel.tp_styles import PLANNED_ATTR

LinearFilter = Callable[[str, nn.Linear], bool]

# Leaf names of the linears the default filter leaves out: output heads and routers (HF MoE routers are `gate`).
SKIPPED_NAMES: frozenset[str] = frozenset({"lm_head", "head", "output", "score", "classifier", "gate", "router"})
ALIGN = 16
# On a linear, set by its model: why it stays in high precision (the model computes with its weight outside forward).
HIGH_PRECISION_ATTR = "fp8_high_precision"
FLOAT8_ALL_GATHER_RECIPE = "tensorwise"  # the recipe torchao's FP8 all-gather of FSDP weights supports
FP8_LINEAR_TYPES = frozenset({"Float8Linear", "MXLinear", "MXFP8Linear"})  # torchao's FP8 linears and ours


def linear_align(recipe: Float8Recipe | None = None) -> int:
    """The multiple a linear's in and out features must be for ``recipe``'s GEMMs: the block size of a block
    recipe, else 16."""
    return recipe.block_size if recipe is not None and recipe.granularity == "block" else ALIGN


def default_linear_filter(fqn: str, module: nn.Linear) -> bool:
    """True unless the linear's own name (the last part of ``fqn``) is an output head or a router
    (:data:`SKIPPED_NAMES`, or a name containing ``router``)."""
    leaf = fqn.rsplit(".", 1)[-1]
    return leaf not in SKIPPED_NAMES and "router" not in leaf


def import_float8(owner: str = "`apply_fp8`") -> ModuleType:
    """``torchao.float8``, or ``ImportError`` with the install hint."""
    try:
        import torchao.float8 as float8  # noqa: PLC0415 - optional backend, imported lazily
    except ImportError as err:
        raise ImportError(
            f"{owner} converts dense linears with torchao's float8 training (`torchao.float8`), which is not "
            f"installed. Install it with {install_hint('fp8')}, or pass dense=False to run only the experts in "
            "FP8 (they need no torchao)."
        ) from err
    return float8


def plan_linears(
    model: nn.Module, module_filter: LinearFilter = default_linear_filter, *, align: int = ALIGN
) -> tuple[list[str], dict[str, str]]:
    """``(convert, skipped)``: the FQNs of the linears to convert, and each linear left out with its reason (a dim
    not a multiple of ``align``: :func:`linear_align`)."""
    convert: list[str] = []
    skipped: dict[str, str] = {}
    for fqn, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if type(module).__name__ in FP8_LINEAR_TYPES:
            skipped[fqn] = "already an FP8 linear"
        elif getattr(module, HIGH_PRECISION_ATTR, None):
            skipped[fqn] = getattr(module, HIGH_PRECISION_ATTR)
        elif not module_filter(fqn, module):
            skipped[fqn] = "left out by the filter (default: output heads and routers stay in high precision)"
        elif module.in_features % align or module.out_features % align:
            skipped[fqn] = (
                f"in_features={module.in_features}, out_features={module.out_features}: FP8 GEMMs need both to be "
                f"multiples of {align}"
            )
        else:
            convert.append(fqn)
    return convert, skipped


def convert_linears(
    model: nn.Module,
    recipe: Float8Recipe,
    module_filter: LinearFilter = default_linear_filter,
    *,
    float8_all_gather: bool = False,
) -> tuple[tuple[str, ...], dict[str, str]]:
    """Swap the chosen linears of ``model`` for torchao's ``Float8Linear`` in place (:func:`plan_linears`), or for
:class:`~lightning_moe_overlap.fp8.mx_linear.MXLinear` (torchao's MX linear) with ``mxfp8``.

    ``float8_all_gather`` (``tensorwise`` only): torchao's ``enable_fsdp_float8_all_gather``, each weight wrapped so
    that ``fully_shard`` casts its shard to float8 before the all-gather (:func:`precompute_float8_scales` after each
    optimizer step computes the scales in one all-reduce).

    Returns:
        ``(converted, skipped)``: the FQNs converted, and each linear left out with its reason.

    Raises:
        ValueError: ``recipe`` is not one of torchao's named recipes, or ``float8_all_gather`` with a recipe other
            than ``tensorwise``.
        NotImplementedError: ``mxfp8`` on a linear of a tensor-parallel plan.
        ImportError: torchao is not installed (and a linear is to be converted).
    """
    if float8_all_gather and recipe.name != FLOAT8_ALL_GATHER_RECIPE:
        raise ValueError(
            f"`apply_fp8`: float8_all_gather=True with recipe {recipe.name!r}: torchao casts a weight to float8 "
            f"before FSDP's all-gather with one scale per tensor, i.e. only for {FLOAT8_ALL_GATHER_RECIPE!r}. Use "
            f"recipe={FLOAT8_ALL_GATHER_RECIPE!r}, or float8_all_gather=False."
        )
    if RECIPES.get(recipe.name) != recipe:
        raise ValueError(
            f"`apply_fp8`: dense linears run torchao's named recipes {list(RECIPES)}, but the recipe is {recipe}. "
            "Pass one of those names, or dense=False to run only the experts with this recipe."
        )
    convert, skipped = plan_linears(model, module_filter, align=linear_align(recipe))
    if convert and recipe.granularity == "block":
        return _convert_mx(model, recipe, convert), skipped
    if convert:
        float8 = import_float8()
        chosen = frozenset(convert)
        # the weight gradient contracts over the micro-batch's tokens, which CUDA's FP8 GEMM wants a multiple of 16
        # of (as every contraction): torchao pads each contraction to it (zeros: the sums are unchanged)
        config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(recipe.name), pad_inner_dim=True)
        if float8_all_gather:
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        float8.float8_linear_utils.swap_linear_layers(
            model,
            lambda linear: _float8_linear(float8, linear, config),
            module_filter_fn=lambda module, fqn: fqn in chosen,
        )
    return tuple(convert), skipped


def _float8_linear(float8: ModuleType, linear: nn.Linear, config: object) -> nn.Linear:
    """torchao's ``Float8Linear`` holding ``linear``'s parameters (what ``convert_to_float8_training`` makes), given
    ``linear``'s tensor-parallel style again when a plan parallelized it."""
    converted = float8.float8_linear.Float8Linear.from_float(linear, config=config)
    planned = getattr(linear, PLANNED_ATTR, None)
    if planned is not None:
        planned.apply_to(converted)
    return converted


def _convert_mx(model: nn.Module, recipe: Float8Recipe, convert: list[str]) -> tuple[str, ...]:
    """Swap the linears ``convert`` (FQNs) of ``model`` for :class:`MXLinear` in place."""
    import_float8()  # the install hint when torchao is missing
    from lightning_moe_overlap.fp8.mx_linear import MXLinear  # noqa: PLC0415 - torchao is imported lazily

    planned = [fqn for fqn in convert if getattr(model.get_submodule(fqn), PLANNED_ATTR, None) is not None]
    if planned:  # checked before any swap: the model is left as it was
        raise NotImplementedError(
            f"`apply_fp8`: the linears {planned} are tensor-parallel (a plan's shards), and recipe {recipe.name!r} "
            "does not run over a tensor-parallel plan yet (torchao's MX linear is not wired with the plan's "
            "styles). Use recipe='rowwise' or 'tensorwise' at tp > 1, or tp=1 with 'mxfp8'."
        )
    for fqn in convert:
        parent_fqn, _, leaf = fqn.rpartition(".")
        parent = model.get_submodule(parent_fqn)
        setattr(parent, leaf, MXLinear.from_linear(getattr(parent, leaf), recipe))
    return tuple(convert)


def precompute_float8_scales(model: nn.Module) -> None:
    """After an optimizer step: the float8 scales of every FSDP-sharded FP8 weight (converted with
    ``float8_all_gather``), in one all-reduce of their amaxes (torchao's ``precompute_float8_dynamic_scale_for_fsdp``),
    so that the next all-gather casts without one. Nothing when no weight is so converted. Collective."""
    import_float8().precompute_float8_dynamic_scale_for_fsdp(model)
