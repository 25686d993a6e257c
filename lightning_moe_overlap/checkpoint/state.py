"""Model and optimizer state through torch's state-dict API, the tensors this rank holds only.

``get_model_state_dict`` / ``get_optimizer_state_dict`` key every entry by the unsplit model's parameter names
(FQNs) and give each tensor in the form the run holds it: a ``DTensor`` ``Shard(0)`` over the ep mesh (an expert
stack, global shape ``[E, ...]``), a ``DTensor`` over an FSDP2 mesh (a dense parameter, replicated or sharded), or
a plain tensor (a model outside the strategy). DCP saves and loads all of them by their global shape. The one layout this module knows: experts built
from an ep process group without a mesh (plain ``[E/ep, ...]`` tensors) are presented as ``DTensor`` s over a mesh
of that group (:func:`plain_expert_meshes`).

The optimizer state is *flat* (``StateDictOptions(flatten_optimizer_state_dict=True)``)::

    state.<fqn>.exp_avg, state.<fqn>.step, ...      one entry per parameter and state name
    param_groups.<fqn>.lr, ...                      each parameter's group hyper-parameters

so every key belongs to one parameter, whatever the optimizer's groups or the ranks' pipeline chunks.

At pp > 1 (docs/pipeline.md) the chunks another pipeline rank runs are on the ``meta`` device: their tensors and
optimizer state are *absent* here. They are left out of what a rank saves and loads, and a meta parameter keeps no
optimizer state.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_moe_overlap.moe.ep import ExpertParallelExperts

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
STATE, GROUPS = "state.", "param_groups."
INFO_KEY = "moe_checkpoint"  # a consolidated checkpoint's record of the layout that wrote it (:mod:`.consolidated`)
_OWNER = "`MoEOverlapStrategy`"


def unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer itself, also when Lightning hands over its ``LightningOptimizer`` wrapper."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def absent_params(module: nn.Module) -> set[str]:
    """Names of ``module``'s parameters on the meta device (other pipeline ranks hold them)."""
    return {n for n, p in module.named_parameters() if p.is_meta}


def absent_keys(module: nn.Module) -> dict[str, torch.Size]:
    """``{key: shape}`` of the state-dict entries of ``module`` on the meta device."""
    return {k: v.shape for k, v in module.state_dict().items() if isinstance(v, Tensor) and v.is_meta}


def param_of(key: str) -> str:
    """The parameter name of a flat optimizer key (``state.<fqn>.<name>`` or ``param_groups.<fqn>.<name>``)."""
    body = key[len(STATE) :] if key.startswith(STATE) else key[len(GROUPS) :]
    return body.rpartition(".")[0]


def in_order(state: dict[str, Any], order: list[str]) -> dict[str, Any]:
    """``state`` with the keys of ``order`` first, in that order (the unsplit module's ``state_dict()`` order)."""
    position = {k: i for i, k in enumerate(order)}
    return dict(sorted(state.items(), key=lambda item: position.get(item[0], len(position))))


def model_state(module: nn.Module) -> dict[str, Any]:
    """The module's state keyed by the unsplit model's names, the held tensors only, each in the run's layout."""
    meshes = plain_expert_meshes(module)
    return {k: _global(v, meshes.get(k)) for k, v in get_model_state_dict(module).items() if not _is_meta(v)}


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, *, template: bool = False) -> dict[str, Any]:
    """The flat optimizer state of the held parameters (group hyper-parameters of every listed parameter).

    An optimizer that has not stepped yet has no state to save: torch's state-dict API initialises it (a step with
    zero gradients and learning rate 0), which would shift the bias correction of the run's first real step, so
    that state is dropped again and only the hyper-parameters are saved. ``template``: keep it (the tensors a load
    reads into).
    """
    absent, meshes = absent_params(module), plain_expert_meshes(module)
    optimizer = unwrapped(optimizer)
    fresh = not optimizer.state
    flat = get_optimizer_state_dict(module, optimizer, options=FLAT)
    if fresh and not template:
        optimizer.state.clear()
        absent = {param_of(k) for k in flat}
    return {
        k: (_global(v, meshes.get(param_of(k))) if k.startswith(STATE) else v)
        for k, v in flat.items()
        if not (k.startswith(STATE) and param_of(k) in absent)
    }


def full_model_state(module: nn.Module, *, cpu_offload: bool) -> dict[str, Any]:
    """The held entries as full (unsharded) tensors: every ``DTensor`` gathered (collective over every rank).

    ``cpu_offload``: only rank 0 keeps the result, on the CPU (every other rank gets an empty dict).
    """
    return _full(model_state(module), cpu_offload)


def full_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, *, cpu_offload: bool) -> dict[str, Any]:
    """The flat optimizer state of the held parameters with full tensors (collective over every rank)."""
    return _full(optimizer_state(module, optimizer), cpu_offload)


def _full(state: Mapping[str, Any], cpu_offload: bool) -> dict[str, Any]:
    keep = not cpu_offload or not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    out = {}
    for k, v in state.items():
        value = v.full_tensor() if isinstance(v, DTensor) else v
        if keep:
            out[k] = value.cpu() if cpu_offload and isinstance(value, Tensor) else value
    return out


def load_model(module: nn.Module, state: Mapping[str, Any], *, strict: bool) -> None:
    """Load ``state`` (held entries, in the run's layout) into ``module``; entries on meta are left as they are.

    Raises:
        RuntimeError: ``strict`` and a held tensor is not in ``state``, or ``state`` has a key the module lacks.
    """
    meshes = plain_expert_meshes(module)
    state = {k: (v.to_local() if k in meshes and isinstance(v, DTensor) else v) for k, v in state.items()}
    result = set_model_state_dict(module, state, options=StateDictOptions(strict=False))
    absent = absent_keys(module)
    missing = [k for k in result.missing_keys if k not in absent]
    if strict and (missing or result.unexpected_keys):
        raise RuntimeError(
            f"{_OWNER}: the checkpoint's state does not fit the tensors this rank holds: {len(missing)} are not in "
            f"it {missing[:5]}, {len(result.unexpected_keys)} of its keys are not in the model "
            f"{result.unexpected_keys[:5]} (tensors on meta, held by other pipeline ranks, are not compared). "
            "Load a checkpoint of this model, or set `strict_loading = False` on the LightningModule."
        )


def load_optimizer(
    module: nn.Module, optimizer: torch.optim.Optimizer, flat: Mapping[str, Any], no_state: Collection[str] = ()
) -> None:
    """Load a flat optimizer state; meta parameters and those in ``no_state`` (saved before they had any) keep none."""
    optimizer, meshes = unwrapped(optimizer), plain_expert_meshes(module)
    flat = {k: (v.to_local() if isinstance(v, DTensor) and param_of(k) in meshes else v) for k, v in flat.items()}
    drop = absent_params(module) | set(no_state)
    if drop:  # torch rebuilds every listed parameter's state: theirs stand in, then go
        live = get_optimizer_state_dict(module, optimizer, options=FLAT)
        flat.update({k: v for k, v in live.items() if k.startswith(STATE) and param_of(k) in drop})
    set_optimizer_state_dict(module, optimizer, flat, options=FLAT)
    if drop:
        for name, p in module.named_parameters():
            if name in drop:
                optimizer.state.pop(p, None)


def like(template: Any, full: Any) -> Any:
    """``full`` (an unsharded value) in the layout of ``template``: this rank's shard of a ``DTensor`` template."""
    if isinstance(template, DTensor):
        full = full.to(dtype=template.dtype, device=template.device_mesh.device_type)
        return distribute_tensor(full, template.device_mesh, template.placements, src_data_rank=None)
    if isinstance(template, Tensor) and isinstance(full, Tensor):
        return full.to(dtype=template.dtype, device=template.device)
    return full


def global_shape(value: Any) -> torch.Size | None:
    """The unsharded shape of a state entry (a ``DTensor``'s global one), ``None`` for a value that is no tensor."""
    return value.shape if isinstance(value, Tensor) else None


def expert_counts(module: nn.Module) -> dict[str, int]:
    """``{state-dict name: number of experts}`` of every per-expert tensor of the expert-parallel modules."""
    counts: dict[str, int] = {}
    for prefix, child in module.named_modules():
        if isinstance(child, ExpertParallelExperts):
            dot = f"{prefix}." if prefix else ""
            for name, _ in [*child.named_parameters(recurse=False), *child.named_buffers(recurse=False)]:
                counts[f"{dot}{name}"] = child.expert_shard.num_experts
    return counts


def plain_expert_meshes(module: nn.Module) -> dict[str, DeviceMesh]:
    """``{name: ep mesh}`` of the expert tensors a rank holds in part as plain ``[n, ...]`` tensors.

    Experts built with the ep mesh are ``DTensor`` s already and need nothing. Experts built from an ep process
    group alone (plain tensors of the local experts) are presented to DCP as ``DTensor`` s ``Shard(0)`` over a
    mesh of that group (their global shape ``[E, ...]``), and handed back as local tensors on load.
    """
    out: dict[str, DeviceMesh] = {}
    meshes: dict[Any, DeviceMesh] = {}
    for prefix, child in module.named_modules():
        if not isinstance(child, ExpertParallelExperts):
            continue
        shard = child.expert_shard
        plain = [(n, p) for n, p in child.named_parameters(recurse=False) if not isinstance(p, DTensor)]
        if shard.num_local == shard.num_experts or not plain or plain[0][1].is_meta:
            continue
        group = child.dispatcher.ep_group
        if group not in meshes:
            meshes[group] = DeviceMesh.from_group(group, plain[0][1].device.type)
        dot = f"{prefix}." if prefix else ""
        names = [n for n, _ in [*child.named_parameters(recurse=False), *child.named_buffers(recurse=False)]]
        out.update({f"{dot}{n}": meshes[group] for n in names})
    return out


def _global(value: Any, mesh: DeviceMesh | None) -> Any:
    if mesh is None or not isinstance(value, Tensor) or isinstance(value, DTensor) or value.dim() == 0:
        return value
    return DTensor.from_local(value, mesh, [Shard(0)], run_check=False)


def _is_meta(value: Any) -> bool:
    return isinstance(value, Tensor) and value.is_meta
