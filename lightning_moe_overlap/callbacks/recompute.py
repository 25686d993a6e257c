"""``SelectiveRecompute``: module-level or full-layer activation recompute as a Lightning callback.

Megatron's ``--recompute-granularity selective --recompute-modules ...`` and ``--recompute-granularity full
--recompute-method uniform|block --recompute-num-layers N``, applied to the model's own layers without changing
its code: when training starts, each named sub-module's ``forward`` (or each layer's) is replaced on the instance
by a non-reentrant ``torch.utils.checkpoint`` of itself, and the expert names (``moe_act``, ``a2a_overlap_mlp``)
add a checkpoint wrapper to a stage of the experts (``experts.stage("act" | "local").add_wrapper``); all of it
is removed at teardown.

It composes with the overlap schedule: a recomputed segment that holds comm points re-runs its all-to-alls inside
the backward context, which only adds hand-overs (docs/overlap.md); full-layer recompute works with ``overlap=True``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from lightning.pytorch import LightningModule, Trainer
from typing_extensions import override

from lightning_moe_overlap.callbacks import _patch
from lightning_moe_overlap.callbacks._attach import Handle, LayerCallback, Target
from lightning_moe_overlap.callbacks._checkpoint import RecomputeContext, checkpointed, recompute_context
from lightning_moe_overlap.callbacks._forward_regions import around_sdpa
from lightning_moe_overlap.callbacks._name_checks import check_names, missing_names_error
from lightning_moe_overlap.callbacks._recompute_units import LayerUnits
from lightning_moe_overlap.callbacks.layer_specs import (
    RECOMPUTE_NAMES,
    CallRegion,
    Layer,
    ModuleRegion,
    StageRegion,
    is_tensor_name,
    present_names,
    user_names,
)

_EXPERT_NAMES = ("moe_act", "a2a_overlap_mlp")
_STAGES = ("local", "act")  # the stages of the experts that can be recomputed (their own checkpoint wrapper)


class SelectiveRecompute(LayerCallback):
    """Recompute activations in backward instead of keeping them: named sub-modules or whole layers.

    Args:
        modules: with ``granularity="selective"``, the sub-modules to recompute in every layer: ``core_attn``
            (the attention kernel), ``mlp`` (the feed-forward block, dense or MoE), ``moe`` (MoE blocks only),
            ``moe_act`` (the routed experts' activation), ``shared_experts``, ``routed_experts`` (dispatch, experts
            and combine), ``layernorm`` (both norms), ``mla_up_proj`` (MLA's q/kv up projections),
            ``a2a_overlap_attn`` (attention norm + attention: the compute before the layer's first comm point),
            ``a2a_overlap_post_attn`` (pre-MLP norm + router), ``a2a_overlap_mlp`` (the expert MLP between dispatch
            and combine), or names added with ``register_layer_names``. See docs/memory.md for the mapping.
        granularity: ``"selective"`` (the listed sub-modules) or ``"full"`` (whole layers).
        method: with ``"full"`` only: ``"uniform"`` checkpoints units of ``num_layers`` consecutive layers (only
            each unit's input is kept); ``"block"`` checkpoints each of the first ``num_layers`` layers. Default
            ``"uniform"``.
        num_layers: with ``"full"`` only: layers per unit (``uniform``, default 1) or layers recomputed
            (``block``, default all).

    Raises:
        ValueError: an unknown name, ``modules`` with ``"full"``, ``method``/``num_layers`` with ``"selective"``,
            a bad ``num_layers``; at fit start, names the model does not have.
        TypeError: ``modules`` is not a list of strings.
    """

    owner = "`SelectiveRecompute`"

    def __init__(
        self,
        modules: list[str] | None = None,
        granularity: Literal["selective", "full"] = "selective",
        method: Literal["uniform", "block"] | None = None,
        num_layers: int | None = None,
    ) -> None:
        super().__init__()
        owner = "`SelectiveRecompute`"
        if granularity not in ("selective", "full"):
            raise ValueError(
                f"{owner}: granularity={granularity!r} is not 'selective' or 'full'. Use 'selective' with `modules`, "
                "or 'full' to recompute whole layers."
            )
        if granularity == "full":
            _check_full(modules, method, num_layers)
            self.modules: tuple[str, ...] = ()
        else:
            if method is not None or num_layers is not None:
                raise ValueError(
                    f"{owner}: method={method!r}, num_layers={num_layers!r} with granularity='selective'; method and "
                    "num_layers choose which whole layers to recompute, so they only apply to granularity='full'. "
                    "Drop them, or set granularity='full' (and no modules)."
                )
            self.modules = check_names(owner, "modules", modules, (*RECOMPUTE_NAMES, *sorted(user_names())))
        self.granularity = granularity
        self._context: RecomputeContext | None = None  # set at fit start (``recompute_context``)
        self.method: Literal["uniform", "block"] = method or "uniform"
        self.num_layers = num_layers

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Attach (``LayerCallback.on_fit_start``); at ``cp > 1`` every recomputation re-enters the ring attention."""
        self._context = recompute_context(pl_module)
        super().on_fit_start(trainer, pl_module)

    def apply(self, model: Target) -> None:
        """Install the recompute on ``model`` (after expert parallelism was applied, for the expert names).

        Args:
            model: the model, or a list of a pipeline rank's chunk modules. With chunks, ``granularity="full"``
                counts layers per chunk: ``uniform`` units never span two chunks, ``block`` recomputes the first
                ``num_layers`` layers of each chunk (all of a chunk's layers when it has fewer), as Megatron counts
                them per pipeline stage.

        Raises:
            TypeError: ``model`` is neither a module nor a non-empty list of modules.
            ValueError: no decoder layer recognised, names absent from the model, or ``block`` with more layers
                than the model (every chunk) has.
        """
        per_part = self._layers(model)
        if self.granularity == "full":
            self._apply_full(per_part)
        else:
            self._apply_selective(model, [layer for layers in per_part for layer in layers])

    def _apply_selective(self, model: Target, layers: list[Layer]) -> None:
        tensors = [n for n in self.modules if is_tensor_name(layers, n)]
        if tensors:
            raise ValueError(
                f"`SelectiveRecompute`: {tensors} name tensors, not modules, in this model; recompute acts on modules. "
                "Offload tensors with `ActivationOffload(tensors=...)`, or map the name onto a module."
            )
        present = present_names(layers, self.modules)
        missing = [n for n in self.modules if n not in present]
        if missing:
            valid = present_names(layers, (*RECOMPUTE_NAMES, *sorted(user_names())))
            raise missing_names_error("`SelectiveRecompute`", "modules", missing, valid, model, _EXPERT_NAMES)
        done: set[tuple[str, int]] = set()
        for layer in layers:
            for name in self.modules:
                for region in layer.resolve(name):
                    self._install(region, done)

    def _install(self, region: Any, done: set[tuple[str, int]]) -> None:
        if isinstance(region, ModuleRegion):
            key = ("forward", id(region.module))
        elif isinstance(region, CallRegion):
            key = ("sdpa", id(region.module))
        elif isinstance(region, StageRegion) and region.stage in _STAGES:
            key = (region.stage, id(region.experts))
        else:
            raise ValueError(
                f"`SelectiveRecompute`: {region} is not something that can be recomputed (a module, the core "
                "attention call, or the 'local'/'act' stage of the experts). Map the name onto a module."
            )
        if key in done:  # two names sharing a module (layernorm and a2a_overlap_attn): one checkpoint
            return
        done.add(key)
        self._handles.append(_checkpoint(region, self._context))

    def _apply_full(self, per_part: list[list[Layer]]) -> None:
        n = self.num_layers
        if self.method == "block":
            most = max(len(layers) for layers in per_part)
            if n is not None and n > most:
                where = "the model has" if len(per_part) == 1 else "the largest of its chunks has"
                raise ValueError(
                    f"`SelectiveRecompute`: method='block' with num_layers={n}, but {where} {most} decoder layers; "
                    "block recompute checkpoints the first num_layers layers (of each chunk). Use num_layers <= "
                    f"{most}."
                )
        for layers in per_part:
            count = len(layers)
            if self.method == "block":
                units = [[i] for i in range(count if n is None else min(n, count))]
            else:
                size = 1 if n is None else n
                units = [list(range(i, min(i + size, count))) for i in range(0, count, size)]
            modules = [layer.module for layer in layers]
            for module, wrap in LayerUnits(modules, units, self._context).wrappers():
                self._handles.append(_patch.wrap_forward(module, wrap, order=_patch.UNIT))

    def __repr__(self) -> str:
        if self.granularity == "full":
            return f"SelectiveRecompute(granularity='full', method={self.method!r}, num_layers={self.num_layers})"
        return f"SelectiveRecompute(modules={list(self.modules)})"


def _checkpoint(region: ModuleRegion | CallRegion | StageRegion, context: RecomputeContext | None) -> Handle:
    """Run ``region`` as a checkpoint: a module's ``forward``, the SDPA call inside a module, or a stage of the
    experts (through its wrapper API); ``context`` is re-entered around each recomputation."""
    if isinstance(region, ModuleRegion):
        return _patch.wrap_forward(region.module, checkpointed(context), order=_patch.CHECKPOINT)
    if isinstance(region, CallRegion):
        around = around_sdpa(lambda func, args, kwargs: checkpointed(context)(func)(*args, **kwargs))
        return _patch.wrap_forward(region.module, around, order=_patch.INNER)
    return region.experts.stage(region.stage).add_wrapper(checkpointed(context))


def _check_full(modules: Sequence[str] | None, method: str | None, num_layers: int | None) -> None:
    owner = "`SelectiveRecompute`"
    if modules:
        raise ValueError(
            f"{owner}: modules={list(modules)} with granularity='full'; full recompute checkpoints whole layers, so a "
            "module list has no meaning there. Drop `modules`, or use granularity='selective'."
        )
    if method not in (None, "uniform", "block"):
        raise ValueError(f"{owner}: method={method!r} is not 'uniform' or 'block' (Megatron's --recompute-method).")
    if num_layers is not None and (isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1):
        raise ValueError(
            f"{owner}: num_layers={num_layers!r} must be a positive integer (layers per unit for 'uniform', layers "
            "recomputed for 'block'), or None for the default."
        )
