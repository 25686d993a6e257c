"""``ActivationOffload``: fine-grained activation offload as a Lightning callback (LoongForge / Megatron flags
``--fine-grained-activation-offloading --offload-modules ... --offload-tensors ... --min-offloaded-tensor-size``
and ``--bindpcie``).

The model's code is not changed. When training starts the callback hooks the model's decoder layers (a group per
layer forward, see :mod:`~lightning_moe_overlap.callbacks.offload_engine`), marks the named regions with forward
pre-hooks and forward hooks (on the named modules and on the stages of the experts, ``experts.stage("fc1" |
"act")``; the core attention, a function call, through a wrapper of the owning module's ``forward``), and tags the
named tensors where they are produced (the pre-MLP norm's output by a forward hook, the dispatched rows by a
forward pre-hook of the experts' ``local`` stage). All of it runs in the thread that runs the forward, where
saved-tensor hooks must be installed: with the overlap, the forward of one micro-batch and the backward of another
run in two threads.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

from lightning_moe_overlap.callbacks import _forward_regions, _patch
from lightning_moe_overlap.callbacks._attach import LayerCallback, Target, parameters_and_buffers
from lightning_moe_overlap.callbacks._name_checks import check_names, missing_names_error
from lightning_moe_overlap.callbacks.layer_specs import (
    OFFLOAD_MODULE_NAMES,
    OFFLOAD_TENSOR_NAMES,
    CallRegion,
    Layer,
    ModuleRegion,
    OutputTag,
    StageRegion,
    is_tensor_name,
    present_names,
    user_names,
)
from lightning_moe_overlap.callbacks.numa import bind_to_device_numa_node
from lightning_moe_overlap.callbacks.offload_engine import OffloadEngine

_EXPERT_NAMES = ("dispatched_input", "expert_fc1", "moe_act")
# Offload names whose tensors a recomputed module does not save at all (nothing left to offload).
_RECOMPUTED_AWAY = {
    "core_attn": {"core_attn"},
    "moe_act": {"moe_act"},
    "layernorm": {"attn_norm", "mlp_norm"},
    "a2a_overlap_attn": {"attn_norm", "core_attn", "attn_proj"},
    "a2a_overlap_mlp": {"dispatched_input", "expert_fc1", "moe_act"},
    "routed_experts": {"dispatched_input", "expert_fc1", "moe_act"},
    "moe": {"dispatched_input", "expert_fc1", "moe_act"},
    "mlp": {"dispatched_input", "expert_fc1", "moe_act"},
}


class ActivationOffload(LayerCallback):
    """Move selected saved activations to host memory in forward and bring them back for backward.

    Args:
        modules: regions whose saved tensors are offloaded: ``attn_norm``, ``core_attn`` (the attention kernel),
            ``attn_proj`` (needs ``core_attn``), ``mlp_norm``, ``expert_fc1`` (the experts' first projection),
            ``moe_act`` (their activation), or names added with ``register_layer_names``.
        tensors: tagged activations offloaded wherever they are saved: ``dispatched_input`` (the rows the token
            dispatcher delivered to the local experts), ``pre_mlp_layernorm_output``.
        min_tensor_size: smallest tensor storage, in bytes, worth moving (``--min-offloaded-tensor-size``).
        numa_bind: bind the process to the CPUs of its GPU's NUMA node when training starts (``--bindpcie``);
            Linux with CUDA only, skipped with a warning elsewhere.

    Raises:
        ValueError: no names, an unknown name, ``attn_proj`` without ``core_attn``, a negative
            ``min_tensor_size``; at fit start, names the model does not have.
        TypeError: ``modules`` or ``tensors`` is not a list of strings.
    """

    owner = "`ActivationOffload`"

    def __init__(
        self,
        modules: list[str] | None = None,
        tensors: list[str] | None = None,
        min_tensor_size: int = 1 << 20,
        numa_bind: bool = False,
    ) -> None:
        super().__init__()
        owner = "`ActivationOffload`"
        users = sorted(user_names())
        self.modules = check_names(owner, "modules", modules, (*OFFLOAD_MODULE_NAMES, *users), required=False)
        self.tensors = check_names(owner, "tensors", tensors, (*OFFLOAD_TENSOR_NAMES, *users), required=False)
        if not self.modules and not self.tensors:
            raise ValueError(
                f"{owner}: modules and tensors are both empty, so nothing would be offloaded. Pass e.g. "
                f"tensors={list(OFFLOAD_TENSOR_NAMES)} and/or modules=['expert_fc1', 'moe_act']."
            )
        if "attn_proj" in self.modules and "core_attn" not in self.modules:
            raise ValueError(
                f"{owner}: modules={list(self.modules)} has 'attn_proj' without 'core_attn'. The projection's input is "
                "the core attention's output, which the core attention saves too, so offloading it alone copies it "
                "to the host without freeing any device memory (Megatron has the same rule). Add 'core_attn'."
            )
        if isinstance(min_tensor_size, bool) or not isinstance(min_tensor_size, int) or min_tensor_size < 0:
            raise ValueError(
                f"{owner}: min_tensor_size={min_tensor_size!r} must be a non-negative number of bytes (tensors "
                "smaller than that stay on the device); the default is 1 MiB."
            )
        self.min_tensor_size = min_tensor_size
        self.numa_bind = numa_bind
        self.engine: OffloadEngine | None = None
        self.bound_cpus: set[int] | None = None

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.numa_bind:
            self.bound_cpus = bind_to_device_numa_node(trainer.strategy.root_device)
        self._warn_if_recomputed(trainer)
        super().on_fit_start(trainer, pl_module)

    def apply(self, model: Target) -> OffloadEngine:
        """Install the offload on ``model`` (after expert parallelism was applied, for the expert names).

        Args:
            model: the model, or a list of a pipeline rank's chunk modules (one engine for all of them).

        Returns:
            The engine (its ``stats`` count what moved).

        Raises:
            TypeError: ``model`` is neither a module nor a non-empty list of modules.
            ValueError: no decoder layer recognised, or names absent from the model or of the wrong kind.
        """
        layers = [layer for layers in self._layers(model) for layer in layers]
        self._check_present(model, layers)
        engine = OffloadEngine(
            modules=self.modules,
            tensors=self.tensors,
            min_tensor_size=self.min_tensor_size,
            exclude=parameters_and_buffers(model),
        )
        self.engine = engine
        for layer in layers:
            regions = [(n, r) for n in (*self.modules, *self.tensors) for r in layer.resolve(n)]
            if regions:
                self._install_layer(layer.module, regions, engine)
        return engine

    def _check_present(self, model: Target, layers: list[Layer]) -> None:
        owner = "`ActivationOffload`"
        for arg, names, want_tensor in (("modules", self.modules, False), ("tensors", self.tensors, True)):
            wrong = [n for n in names if n in present_names(layers, [n]) and is_tensor_name(layers, n) != want_tensor]
            if wrong:
                kind, other = ("module", "modules") if want_tensor else ("tensor", "tensors")
                raise ValueError(
                    f"{owner}: {arg} has {wrong}, which name {kind}s in this model; list them under `{other}`."
                )
            present = present_names(layers, names)
            missing = [n for n in names if n not in present]
            if missing:
                catalogue = OFFLOAD_TENSOR_NAMES if want_tensor else OFFLOAD_MODULE_NAMES
                valid = present_names(layers, (*catalogue, *sorted(user_names())))
                raise missing_names_error(owner, arg, missing, valid, model, _EXPERT_NAMES)

    def _install_layer(self, layer: nn.Module, regions: list[tuple[str, Any]], engine: OffloadEngine) -> None:
        self._handles.append(layer.register_forward_pre_hook(lambda module, args: engine.open_group()))
        self._handles.append(
            layer.register_forward_hook(lambda module, args, out: engine.close_group(), always_call=True)
        )
        for name, region in regions:
            if isinstance(region, ModuleRegion):
                self._mark(region.module, name)
            elif isinstance(region, CallRegion):
                wrap = _forward_regions.around_sdpa(_forward_regions.in_region(name))
                self._handles.append(_patch.wrap_forward(region.module, wrap, order=_patch.INNER))
            elif isinstance(region, OutputTag):
                self._handles.append(region.module.register_forward_hook(_tag_output(engine, name)))
            elif isinstance(region, StageRegion) and region.stage == "input":  # the rows entering the expert MLP
                local = region.experts.stage("local")
                self._handles.append(local.register_forward_pre_hook(_tag_input(engine, name)))
            elif isinstance(region, StageRegion):
                self._mark(region.experts.stage(region.stage), name)

    def _mark(self, module: nn.Module, name: str) -> None:
        """Region ``name`` while ``module`` runs (its forward pre-hook enters it, its forward hook leaves it)."""
        self._handles.append(module.register_forward_pre_hook(lambda m, args: _forward_regions.enter(name)))
        self._handles.append(
            module.register_forward_hook(lambda m, args, out: _forward_regions.leave(name), always_call=True)
        )

    def _warn_if_recomputed(self, trainer: Trainer) -> None:
        from lightning_moe_overlap.callbacks.recompute import SelectiveRecompute

        wanted = {*self.modules, *self.tensors}
        for cb in trainer.callbacks:  # type: ignore[attr-defined]
            if not isinstance(cb, SelectiveRecompute):
                continue
            moot = wanted if cb.granularity == "full" else wanted & set().union(
                *(_RECOMPUTED_AWAY.get(n, set()) for n in cb.modules)
            )
            if moot:
                rank_zero_warn(
                    f"`ActivationOffload`: {sorted(moot)} are inside modules that {cb!r} recomputes, so they are not "
                    "saved and there is nothing to offload for them. Drop them from one of the two callbacks."
                )

    def __repr__(self) -> str:
        return f"ActivationOffload(modules={list(self.modules)}, tensors={list(self.tensors)})"


def _tag_input(engine: OffloadEngine, name: str) -> Any:
    def hook(module: nn.Module, args: tuple) -> None:
        engine.tag(name, args[0])

    return hook


def _tag_output(engine: OffloadEngine, name: str) -> Any:
    def hook(module: nn.Module, args: Any, out: Any) -> None:
        tensor = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(tensor, Tensor):
            engine.tag(name, tensor)

    return hook
