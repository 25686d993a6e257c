"""Expert parallelism at the experts module: keep this rank's experts, route tokens to their owners and back.

``ExpertParallelExperts`` replaces an experts module (our :class:`~lightning_moe_overlap.moe.experts.Experts`
or a Hugging Face v5 one) and keeps its forward signature ``(hidden_states_TD, top_k_index_TK,
top_k_weights_TK) -> out_TD``, so the router, shared experts and the rest of the model stay untouched. It holds
only experts ``[ep_rank * E / ep, (ep_rank + 1) * E / ep)``, as new parameters under the original names, and an
:class:`ExpertShard` saying which global experts those are. Given the ep ``DeviceMesh``, each parameter is a
``DTensor`` sharded ``Shard(0)`` over it: global shape ``[E, ...]``, local shard ``[E / ep, ...]`` (torchtitan's
layout), so the state-dict API and ``torch.distributed.checkpoint`` see whole experts and reshard them across ep;
the experts compute on the local shard, and a delayed weight gradient (``delay_wgrad``) accumulates into the
``DTensor``'s local gradient (``grad_target`` of :func:`~lightning_moe_overlap.moe.grouped.grouped_projection`).

Forward: capacity drop (optional, on local tokens) -> ``dispatcher.dispatch`` -> grouped MLP of the local
experts -> ``dispatcher.combine``. On each rank the result equals the unsharded module's on that rank's tokens.
The expert MLP runs as named stage modules (``local``: ``fc1`` -> ``act`` -> ``fc2``; :mod:`.stages`), which hooks,
checkpoints and the memory callbacks attach to; the parameters stay on this module.

:func:`apply_expert_parallel` makes them: it finds a model's experts modules (``adapters.py``) and replaces each with
its ``ExpertParallelExperts`` in place.

Shape legend:
    T: tokens on this rank   K: top-k   D: hidden size   R: rows for local experts   e: local experts
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_moe_overlap.float8.recipes import Float8Recipe
from lightning_moe_overlap.moe.adapters import FoundExperts, find_experts
from lightning_moe_overlap.moe.capacity import DropPolicy, drop_over_capacity, validate_capacity
from lightning_moe_overlap.moe.dispatch.base import DispatcherBase, check_expert_split
from lightning_moe_overlap.moe.dispatch.comm import group_size
from lightning_moe_overlap.moe.dispatch.deepep_buffers import DeepEPBuffers
from lightning_moe_overlap.moe.dispatch.factory import build_dispatcher
from lightning_moe_overlap.moe.grouped import (
    GemmImpl,
    ProjectionKernel,
    RowSplits,
    check_activation,
    check_impl,
    expert_activation,
    grouped_projection,
    row_splits,
)
from lightning_moe_overlap.moe.layer import MoELayer
from lightning_moe_overlap.moe.experts_layout import ExpertsLayout
from lightning_moe_overlap.moe.layout_check import check_layout_math
from lightning_moe_overlap.moe.placement import ExpertPlacement
from lightning_moe_overlap.moe.replica_slots import ReplicaSlots
from lightning_moe_overlap.moe.shared import overlap_shared_experts
from lightning_moe_overlap.moe.stages import STAGE_NAMES, ExpertsStage
from lightning_moe_overlap.moe.te_backend import EXPERT_BACKENDS, ExpertBackend, TEExperts, check_te_layout
from lightning_moe_overlap.overlap.runtime import CommRuntime
from lightning_moe_overlap.parallel.dtensors import like, local


@dataclass(frozen=True)
class ExpertShard:
    """Which global experts a rank holds: local expert ``i`` is global expert ``first_expert + i``."""

    num_experts: int
    first_expert: int
    num_local: int

    def global_index(self, local_index: int) -> int:
        if not 0 <= local_index < self.num_local:
            raise ValueError(
                f"`ExpertShard.global_index`: local_index={local_index} is outside [0, {self.num_local}); this "
                f"shard holds global experts [{self.first_expert}, {self.first_expert + self.num_local})."
            )
        return self.first_expert + local_index

    @property
    def global_range(self) -> range:
        return range(self.first_expert, self.first_expert + self.num_local)


class ExpertParallelExperts(nn.Module):
    """This rank's slice of an experts module plus the token dispatcher that feeds it.

    Args:
        source: the unsharded experts module; its weights are sliced and cloned (it can be freed afterwards).
        layout: how ``source`` stores and computes its experts (from its adapter).
        dispatcher: the token dispatcher (defines the ep group and which experts are local).
        capacity_factor: drop assignments beyond ``ceil(T*K/E * factor)`` per expert on local tokens; ``None``
            is dropless.
        token_drop_policy: ``"probs"`` or ``"position"``.
        impl: grouped GEMM implementation (``"auto"``, ``"grouped_mm"``, ``"loop"``).
        expert_backend: ``"torch"`` (:func:`~lightning_moe_overlap.moe.grouped_mlp`) or ``"te"`` (Transformer
            Engine's ``GroupedLinear``, imported on the first forward; see ``moe/te_backend.py``).
        ep_mesh: the 1-D mesh of the dispatcher's ep group (same ranks, same order); the parameters are then
            ``DTensor``s ``Shard(0)`` over it. ``None`` keeps plain tensors holding the local experts.
    """

    moe_overlap_expert_parallel = True  # adapters.EXPERT_PARALLEL_ATTR: `find_experts` skips it

    def __init__(
        self,
        source: nn.Module,
        layout: ExpertsLayout,
        dispatcher: DispatcherBase,
        *,
        capacity_factor: float | None = None,
        token_drop_policy: DropPolicy = "probs",
        impl: GemmImpl = "auto",
        expert_backend: ExpertBackend = "torch",
        ep_mesh: DeviceMesh | None = None,
    ) -> None:
        super().__init__()
        validate_capacity(capacity_factor, token_drop_policy, owner="`ExpertParallelExperts`")
        if expert_backend not in EXPERT_BACKENDS:
            raise ValueError(
                f"`ExpertParallelExperts`: expert_backend={expert_backend!r} is not one of {list(EXPERT_BACKENDS)}; "
                "pick 'torch' (pure PyTorch, runs everywhere) or 'te' (Transformer Engine, CUDA)."
            )
        if expert_backend == "te":
            check_te_layout(layout, owner="`ExpertParallelExperts`")
            if getattr(dispatcher, "static", False):
                raise NotImplementedError(
                    "`ExpertParallelExperts`: expert_backend='te' with a static all-to-all dispatch; Transformer "
                    "Engine's GroupedLinear takes its row splits on the host, which the static layout never reads. "
                    "Use expert_backend='torch' (its grouped GEMM reads the counts on the device) or static=False."
                )
        check_impl(impl, owner="`ExpertParallelExperts`")
        check_activation(layout.act_fn, layout.gate_fn, owner="`ExpertParallelExperts`")
        missing = [name for name in layout.parameter_names if not isinstance(getattr(source, name, None), Tensor)]
        if missing:
            raise ValueError(
                f"`ExpertParallelExperts`: the layout names {missing}, which {type(source).__name__} does not have as "
                "tensors; a layout must name the module's own per-expert parameters. Fix the adapter's layout."
            )
        extra = sorted(name for name, _ in source.named_parameters() if name not in layout.parameter_names)
        if extra:
            raise NotImplementedError(
                f"`ExpertParallelExperts`: {type(source).__name__} has parameters {extra} that its layout does not "
                f"describe (layout: {list(layout.parameter_names)}); sharding would lose them. Register an adapter "
                "whose layout covers every per-expert parameter (docs/adapters.md), or keep ep=1."
            )
        num_experts = getattr(source, layout.up_name).shape[0]
        if num_experts != dispatcher.num_experts:
            raise ValueError(
                f"`ExpertParallelExperts`: the experts module has {num_experts} experts but the dispatcher was built "
                f"for num_experts={dispatcher.num_experts}; they must match. Build the dispatcher from this module."
            )
        first, count = dispatcher.first_expert, dispatcher.num_local_experts
        _check_mesh(ep_mesh, dispatcher)
        # Keep the source's parameter order, so optimizers and checkpoints see the same sequence of names.
        for name in [n for n in source._parameters if n in layout.parameter_names]:
            full = getattr(source, name)
            if full.shape[0] != num_experts:
                raise ValueError(
                    f"`ExpertParallelExperts`: `{name}` has {full.shape[0]} rows in dim 0 but `{layout.up_name}` has "
                    f"{num_experts}; every per-expert tensor must lead with the expert dimension. Register an "
                    "adapter whose layout names only per-expert tensors (docs/adapters.md)."
                )
            shard = full.detach()[first : first + count].clone()
            if ep_mesh is not None:
                shard = DTensor.from_local(shard, ep_mesh, [Shard(0)], run_check=False)
            self.register_parameter(name, nn.Parameter(shard, requires_grad=full.requires_grad))
        self.layout = layout
        self.act_fn = layout.act_fn
        self.dispatcher = dispatcher
        self.runtime = dispatcher.runtime
        self.expert_shard = ExpertShard(num_experts=num_experts, first_expert=first, num_local=count)
        self.num_experts = num_experts
        self.num_local_experts = count
        # Which logical expert each slot (row) holds; the identity unless re-placed (`moe/placement.py`).
        self.placement = ExpertPlacement.identity(num_experts, dispatcher.ep_size)
        self._slot_table: Tensor | None = None  # the placement's slot of each logical expert, None for the identity
        self.replica_slots: ReplicaSlots | None = None  # with replicas: their rows and the dispatch over E + R slots
        self.capacity_factor = capacity_factor
        self.token_drop_policy: DropPolicy = token_drop_policy
        self.impl: GemmImpl = impl
        # The torch backend's projection kernel (None: GroupedLinear; FP8: `fp8.apply_fp8`), kept from the source.
        self.kernel: ProjectionKernel | None = getattr(source, "kernel", None)
        # With an FP8 kernel and a dispatcher that can: send the rows in FP8 (False keeps them in high precision).
        self.fp8_dispatch = True
        self.expert_backend: ExpertBackend = expert_backend
        # TE's modules are views of the parameters above, kept off the module tree (state_dict is unchanged).
        self.te_experts: TEExperts | None = None
        if expert_backend == "te":
            self.te_experts = TEExperts(getattr(self, layout.up_name), getattr(self, layout.down_name))
        # The expert MLP as module calls (no parameters of their own: state_dict and parameters() are unchanged).
        self.stages = nn.ModuleDict(
            {
                "local": ExpertsStage("local", self._run_local),
                "fc1": ExpertsStage("fc1", self._run_fc1),
                "act": ExpertsStage("act", self._run_act),
                "fc2": ExpertsStage("fc2", self._run_fc2),
            }
        )

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """Same contract as the module it replaced: ``[T, D], [T, K], [T, K] -> [T, D]`` (leading dims kept)."""
        shape = hidden_states.shape
        x_TD = hidden_states.reshape(-1, shape[-1])
        indices_TK = top_k_index.reshape(-1, top_k_index.shape[-1])
        weights_TK = top_k_weights.reshape(-1, top_k_weights.shape[-1])
        if self.capacity_factor is not None:
            indices_TK, weights_TK = drop_over_capacity(
                indices_TK, weights_TK, self.num_experts, self.capacity_factor, self.token_drop_policy
            )
        dispatcher = self.dispatcher
        if self.replica_slots is not None:  # replicated experts: each choice to one copy
            indices_TK, dispatcher = self.replica_slots.route(indices_TK), self.replica_slots.dispatcher
        elif self._slot_table is not None:  # re-placed experts: route to the slots holding them
            indices_TK = ExpertPlacement.to_slots(indices_TK, self._slot_table)
        fp8 = self.dispatch_recipe()
        if fp8 is None:
            x_RD, splits, handle = dispatcher.dispatch(x_TD, indices_TK, weights_TK)
        else:  # the rows travel in FP8 and the FP8 kernel reads them as they are (docs/fp8.md, "FP8 dispatch")
            x_RD, splits, handle = dispatcher.dispatch(x_TD, indices_TK, weights_TK, fp8=fp8)
        y_RD = self.local_experts(x_RD, splits)
        return dispatcher.combine(y_RD, handle).view(shape)

    def set_placement(self, placement: ExpertPlacement) -> None:
        """Route by ``placement`` from the next forward on. Only the map changes: the rows must already hold the
        experts it names (``moe/expert_moves.py`` moves them).

        Raises:
            ValueError: ``placement`` is for another number of experts or another ep.
        """
        if (placement.num_experts, placement.ep) != (self.num_experts, self.dispatcher.ep_size):
            raise ValueError(
                f"`ExpertParallelExperts.set_placement`: the placement has {placement.num_experts} experts over "
                f"ep={placement.ep}, but this module holds {self.num_experts} over ep={self.dispatcher.ep_size}; "
                "build the placement for this module (`ExpertPlacement.identity(E, ep)` and what it leads to)."
            )
        if placement.replicas and getattr(self.dispatcher, "static", False):
            raise NotImplementedError(
                "`ExpertParallelExperts.set_placement`: replicas of experts route through a dispatcher for E + R "
                "slots, which the static all-to-all layout does not size yet; this module's dispatcher has "
                "static=True. Re-place without replicas, or use alltoall_static=False."
            )
        if placement.replicas and (self.te_experts is not None or self.kernel is not None):
            raise NotImplementedError(
                f"`ExpertParallelExperts.set_placement`: replicas of experts run on the torch backend's own GEMMs; "
                f"this module has expert_backend={self.expert_backend!r} and kernel={type(self.kernel).__name__}. "
                "Re-place without replicas, or use expert_backend='torch' without FP8."
            )
        device = local(getattr(self, self.layout.up_name)).device
        self.placement = placement
        self._slot_table = None if placement.is_identity else placement.slot_table(device)
        params = dict(self.named_parameters(recurse=False))
        self.replica_slots = ReplicaSlots(placement, self.dispatcher, params) if placement.replicas else None

    def dispatch_recipe(self) -> Float8Recipe | None:
        """The FP8 recipe the rows are dispatched in, or None (high precision): the recipe of an FP8 ``kernel``
        (its ``dispatch_recipe``) when the dispatcher sends FP8 (``fp8_dispatch``) and ``fp8_dispatch`` is on here."""
        recipe = getattr(self.kernel, "dispatch_recipe", None)
        return recipe if self.fp8_dispatch and self.dispatcher.fp8_dispatch else None

    def stage(self, name: str) -> ExpertsStage:
        """The stage module ``name``: ``local`` (the expert MLP), ``fc1``, ``act`` or ``fc2`` (see :mod:`.stages`).

        Raises:
            ValueError: ``name`` is not one of them.
        """
        if name not in STAGE_NAMES:
            raise ValueError(
                f"`ExpertParallelExperts.stage`: {name!r} is not a stage of the experts; the stages are "
                f"{list(STAGE_NAMES)}. Pass one of those."
            )
        return self.stages[name]  # type: ignore[return-value]

    def local_experts(self, x_RD: Tensor, splits: RowSplits | Sequence[int] | Tensor) -> Tensor:
        """The local experts on the rows a dispatch returned with ``splits`` (its :class:`RowSplits`; row counts per
        local expert, rows sorted by local expert, are taken too)."""
        return self.stages["local"](x_RD, splits)

    # -- the stages' computations ---------------------------------------------------------------------------------
    def _run_local(self, x_RD: Tensor, splits: RowSplits | Sequence[int] | Tensor) -> Tensor:
        slots = self.num_local_experts if self.replica_slots is None else self.replica_slots.local_slots
        splits = row_splits(splits, slots, x_RD.shape[0], "`ExpertParallelExperts`")
        h = self.stages["fc1"](x_RD, splits)
        h = self.stages["act"](h)
        h = self.dispatcher.balance_backward(h)
        return self.stages["fc2"](h, splits)

    def _run_fc1(self, x_RD: Tensor, splits: RowSplits) -> Tensor:
        layout = self.layout
        if self.te_experts is not None:
            return self.te_experts.gate_up(x_RD, splits.sorted_rows().host_sizes(), self.runtime)
        return self._project(x_RD, splits, layout.up_name, layout.up_bias_name)

    def _run_act(self, h_RF2: Tensor) -> Tensor:
        return expert_activation(h_RF2, self.act_fn, gate_fn=self.layout.gate_fn, gated=self.layout.gated)

    def _run_fc2(self, h_RF: Tensor, splits: RowSplits) -> Tensor:
        layout = self.layout
        if self.te_experts is not None:
            return self.te_experts.down(h_RF, splits.sorted_rows().host_sizes(), self.runtime)
        return self._project(h_RF, splits, layout.down_name, layout.down_bias_name)

    def _project(self, x_RI: Tensor, splits: RowSplits, weight_name: str, bias_name: str | None) -> Tensor:
        weight = getattr(self, weight_name)  # a DTensor over the ep mesh: the kernels run on its local shard
        replicas = self.replica_slots
        if replicas is not None:  # the primaries' rows, then the replicas' (no deferred wgrad: validated)
            bias = replicas.weight(bias_name, local(getattr(self, bias_name))) if bias_name else None
            rows = replicas.weight(weight_name, local(weight))
            return grouped_projection(x_RI, rows, splits, bias=bias, transposed=self.layout.transposed,
                                      runtime=self.runtime, impl=self.impl)  # fmt: skip
        return grouped_projection(
            x_RI,
            local(weight),
            splits,
            bias=local(getattr(self, bias_name)) if bias_name else None,
            transposed=self.layout.transposed,
            runtime=self.runtime,
            impl=self.impl,
            grad_target=weight,  # a deferred weight gradient lands in the DTensor's local gradient
            kernel=self.kernel,
        )

    def extra_repr(self) -> str:
        shard = self.expert_shard
        return (
            f"experts=[{shard.first_expert}, {shard.first_expert + shard.num_local}) of {shard.num_experts}, "
            f"dispatcher={self.dispatcher.name!r}, capacity_factor={self.capacity_factor}"
            + (f", expert_backend={self.expert_backend!r}" if self.expert_backend != "torch" else "")
        )

    def to_empty_shards(self, device: torch.device | str) -> None:
        """Give each parameter on the meta device (a source built on meta was sliced) an uninitialised local shard on
        ``device``, in the same layout (a ``DTensor`` over the same mesh, the same global shape); the others stay.
        The caller fills them (``parallelize/materialize.py``: a seeded init or a checkpoint)."""
        for name, param in list(self.named_parameters(recurse=False)):
            if not param.is_meta:
                continue
            shard = torch.empty_like(local(param), device=device)
            self.register_parameter(name, nn.Parameter(like(param, shard), requires_grad=param.requires_grad))
        if self.te_experts is not None:  # TE's views follow the new parameters
            self.te_experts = TEExperts(getattr(self, self.layout.up_name), getattr(self, self.layout.down_name))

    def local_parameter_bytes(self) -> int:
        """Bytes of the expert parameters held on this rank."""
        return sum(local(p).numel() * p.element_size() for p in self.parameters(recurse=False))


def _check_mesh(ep_mesh: DeviceMesh | None, dispatcher: DispatcherBase) -> None:
    """The mesh must be the dispatcher's ep group: the same size, this rank at the same position."""
    if ep_mesh is None:
        return
    ep, ep_rank = dispatcher.ep_size, dispatcher.ep_rank
    rank = ep_mesh.get_local_rank() if ep_mesh.ndim == 1 else None
    if ep_mesh.ndim != 1 or ep_mesh.size() != ep or rank != ep_rank:
        raise ValueError(
            f"`ExpertParallelExperts`: ep_mesh has shape {tuple(ep_mesh.shape)} with this rank at {rank}, but the "
            f"dispatcher's ep group has {ep} ranks with this rank at {ep_rank}; the "
            "experts' DTensors must be sharded over the ep group itself. Pass `ParallelMesh['ep']` of the same dims."
        )


# -- making a model's experts expert-parallel --------------------------------------------------------------------------
def _ep_group_of(groups_or_ep_group: Any) -> ProcessGroup | None:
    if groups_or_ep_group is None or isinstance(groups_or_ep_group, ProcessGroup):
        return groups_or_ep_group
    group = getattr(groups_or_ep_group, "ep", None)
    if isinstance(group, ProcessGroup):
        return group
    raise TypeError(
        f"`apply_expert_parallel`: got {type(groups_or_ep_group).__name__} for the groups; expected a "
        "`ParallelGroups` (its `.ep` is used), a `ProcessGroup` (the ep group) or None (single process)."
    )


def apply_expert_parallel(
    model: nn.Module,
    groups_or_ep_group: Any,
    *,
    dispatcher: str = "alltoall",
    runtime: CommRuntime | None = None,
    capacity_factor: float | None = None,
    token_drop_policy: DropPolicy = "probs",
    impl: GemmImpl = "auto",
    expert_backend: ExpertBackend = "torch",
    shared_expert_overlap: bool = False,
    ep_mesh: DeviceMesh | None = None,
    **knobs: Any,
) -> list[ExpertParallelExperts]:
    """Replace every recognised experts module of ``model`` by its expert-parallel version, in place.

    Collective-free (each rank slices its own experts), but every rank of the ep group must call it on the same
    model so their layers line up. Every :class:`~lightning_moe_overlap.moe.layer.MoELayer` parent also gets
    ``runtime`` (for ``shared_expert_overlap``); with ``shared_expert_overlap=True`` every block with shared
    experts runs them inside the dispatch window (``MoELayer``, and HF blocks through ``moe/shared.py``).

    Args:
        model: the user's model.
        groups_or_ep_group: a ``ParallelGroups`` (its ``ep`` is used), the ep ``ProcessGroup``, or ``None``.
        dispatcher: ``"alltoall"``, ``"allgather"`` or ``"flex"``.
        runtime: the strategy's :class:`CommRuntime` (shared by every layer).
        capacity_factor: per-expert capacity factor on local tokens; ``None`` is dropless. The experts drop with it,
            except under a ``MoELayer`` that drops with its own (each layer drops once).
        token_drop_policy: ``"probs"`` or ``"position"``.
        impl: grouped GEMM implementation.
        expert_backend: ``"torch"`` (pure PyTorch GEMMs) or ``"te"`` (Transformer Engine ``GroupedLinear``).
        shared_expert_overlap: run each block's shared experts between issuing the dispatch and waiting on it
            (needs ``runtime``); blocks without shared experts are left as they are.
        ep_mesh: the 1-D ``DeviceMesh`` of the ep group; the expert parameters become ``DTensor``s ``Shard(0)``
            over it (``None``: plain tensors holding the local experts).
        **knobs: dispatcher knobs (see :func:`~lightning_moe_overlap.moe.dispatch.build_dispatcher`). With
            ``dispatcher="flex"`` and no ``deepep_buffers`` / ``deepep_buffer``, one
            :class:`~lightning_moe_overlap.moe.dispatch.DeepEPBuffers` is made here and shared by every layer.

    Returns:
        The new modules, in model order.

    Raises:
        ValueError: a block's ``num_experts`` is not divisible by ep, or its own forward and its layout's math
            disagree on a few test tokens (both checked for every block before any change; see
            :func:`~lightning_moe_overlap.moe.layout_check.check_layout_math`), or a bad capacity setting, or one
            that differs from a ``MoELayer``'s own.
        TypeError: ``groups_or_ep_group`` of the wrong kind, an unknown knob, or a layout naming something that is
            not a 3-D per-expert tensor of its module (e.g. a list of per-expert modules).
        NotImplementedError: an experts module variant that cannot be sharded (or mapped onto TE).
        ImportError: ``dispatcher="flex"`` without DeepEP / CUDA.
    """
    ep_group = _ep_group_of(groups_or_ep_group)
    validate_capacity(capacity_factor, token_drop_policy, owner="`apply_expert_parallel`")
    ep = group_size(ep_group)
    found = find_experts(model)
    experts_capacity: dict[str, float | None] = {}
    layouts: dict[str, ExpertsLayout] = {}
    for name, item in found.items():
        check_expert_split(item.num_experts, ep, owner=f"`apply_expert_parallel` ({name})")
        experts_capacity[name] = _experts_capacity(item, capacity_factor, token_drop_policy)
        layouts[name] = item.adapter.layout(item.module)
        check_layout_math(name, item.module, item.adapter.name, layouts[name])  # its forward is not called after
    if dispatcher == "flex" and knobs.get("deepep_buffers") is None and knobs.get("deepep_buffer") is None:
        # One DeepEP buffer per process, shared by every layer (each buffer pins hundreds of MB of NVLink memory).
        knobs = {**knobs, "deepep_buffers": DeepEPBuffers(knobs.get("deepep_num_sms", 20))}
    wrapped: list[ExpertParallelExperts] = []
    for name, item in found.items():
        layout = layouts[name]
        token_dispatcher = build_dispatcher(dispatcher, ep_group, item.num_experts, runtime, **knobs)
        if getattr(token_dispatcher, "static", False):  # its slots hold what the layer keeps
            token_dispatcher.slot_capacity_factor = _drop_factor(item, experts_capacity[name])
        ep_module = ExpertParallelExperts(
            item.module,
            layout,
            token_dispatcher,
            capacity_factor=experts_capacity[name],
            token_drop_policy=token_drop_policy,
            impl=impl,
            expert_backend=expert_backend,
            ep_mesh=ep_mesh,
        )
        ep_module.train(item.module.training)  # the mode the replaced module had (from_pretrained: eval)
        setattr(item.parent, item.attr, ep_module)
        if isinstance(item.parent, MoELayer):
            item.parent.runtime = runtime
            if shared_expert_overlap and item.parent.shared_experts is not None:
                item.parent.shared_expert_overlap = True
        elif shared_expert_overlap and runtime is not None:
            overlap_shared_experts(item.parent, runtime)
        wrapped.append(ep_module)
    return wrapped


def _drop_factor(item: FoundExperts, experts_capacity: float | None) -> float | None:
    """The capacity factor a layer drops with: its experts' (applied here), or its ``MoELayer``'s own."""
    layer = item.parent
    if experts_capacity is None and isinstance(layer, MoELayer):
        return layer.capacity_factor
    return experts_capacity


def _experts_capacity(item: FoundExperts, capacity_factor: float | None, token_drop_policy: str) -> float | None:
    """The factor the expert-parallel module drops with, so that a layer drops over capacity exactly once.

    A :class:`MoELayer` with a ``capacity_factor`` of its own drops before its experts: its experts get ``None``.
    The same setting given here too is that one drop; a different one is an error (two drops would keep the
    smaller capacity, which neither setting says).
    """
    layer = item.parent
    if not isinstance(layer, MoELayer) or layer.capacity_factor is None:
        return capacity_factor
    if capacity_factor is not None and (capacity_factor, token_drop_policy) != (
        layer.capacity_factor,
        layer.token_drop_policy,
    ):
        raise ValueError(
            f"`apply_expert_parallel` ({item.name}): capacity_factor={capacity_factor!r}, "
            f"token_drop_policy={token_drop_policy!r} given here, but its `MoELayer` drops with "
            f"capacity_factor={layer.capacity_factor!r}, token_drop_policy={layer.token_drop_policy!r}; a layer drops "
            "over capacity once, with one setting. Set the capacity in one place (the `MoELayer`, or here, e.g. "
            "`MoEOverlapStrategy(capacity_factor=...)`), or give both the same values."
        )
    return None
