"""Optimizer state in the layout-free form: keyed by parameter name, one entry per expert for expert parameters.

``torch.optim.Optimizer.state_dict()`` keys state by the parameter's position (``{"state": {3: {...}},
"param_groups": [{"params": [0, 1, ...], ...}]}``), and an expert parameter's state tensors are as local as the
parameter (``exp_avg [n, 2F, D]``). The canonical form keys state by the parameter's name and splits the per-expert
tensors like the model's (:mod:`.keys`)::

    {"state": {"embed.weight": {"step": t, "exp_avg": t, ...},
               "layers.0.mlp.experts.down_proj": {"step": t},          # state shared by the experts
               "layers.0.mlp.experts.down_proj[4]": {"exp_avg": t, ...}, ...},  # one entry per expert
     "param_groups": [{"lr": ..., "params": ["embed.weight", ...]}]}

Rule: a state tensor of an expert parameter with at least one dimension leads with the expert dimension (Adam's
moments, Adafactor's factored ones); 0-dim tensors (``step``) and other values are shared by the experts.

At pp > 1 (:mod:`.held`) a rank has state for the parameters it holds only. Its optimizer may list every parameter
of the unsplit model (the meta ones never step) or only the held ones; either way the saved ``param_groups`` name
every parameter of the unsplit model (:func:`merge_param_groups`), and a loading rank takes the names it has.

Shape legend: n local experts, E experts of the module.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_moe_overlap.checkpoint.keys import expert_key, split_key
from lightning_moe_overlap.moe.ep import ExpertShard


def param_names(optimizer: torch.optim.Optimizer, module: nn.Module) -> list[str]:
    """The name in ``module`` of each parameter of ``optimizer``, in the order of its state dict's indices.

    Raises:
        ValueError: the optimizer holds a parameter that ``module`` does not have.
    """
    names = {id(p): n for n, p in module.named_parameters()}
    out: list[str] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"`{type(optimizer).__name__}` holds a parameter of shape {tuple(p.shape)} that is not a parameter "
                    "of the LightningModule; checkpoints name optimizer state by parameter name. Optimize only the "
                    "module's own parameters (`self.parameters()` in `configure_optimizers`)."
                )
            out.append(names[id(p)])
    return out


def optimizer_to_canonical(
    state_dict: Mapping[str, Any],
    names: Sequence[str],
    shards: Mapping[str, ExpertShard],
    absent: Collection[str] = (),
) -> dict[str, Any]:
    """Canonical form of a local ``optimizer.state_dict()``; ``names[i]`` names the parameter of index ``i``.

    State of ``absent`` parameters (on meta here: another pp rank holds them) is left out.
    """
    state: dict[str, dict[str, Any]] = {}
    for index, entry in state_dict["state"].items():
        name = names[index]
        if name in absent:
            continue
        shard = shards.get(name)
        if shard is None:
            state[name] = dict(entry)
            continue
        shared, per_expert = _split_entry(name, entry, shard.num_local, "local experts")
        state[name] = shared
        for i, expert in enumerate(shard.global_range):
            state[expert_key(name, expert)] = {k: v[i] for k, v in per_expert.items()}
    return {"state": state, "param_groups": _named_groups(state_dict["param_groups"], names)}


def optimizer_from_canonical(
    canonical: Mapping[str, Any],
    names: Sequence[str],
    shards: Mapping[str, ExpertShard],
    where: str,
    absent: Collection[str] = (),
) -> dict[str, Any]:
    """A local ``optimizer.state_dict()`` for the optimizer whose parameters are ``names`` (this rank's experts).

    ``absent`` parameters (on meta here) get no state, and saved ones the optimizer does not list are skipped.

    Raises:
        ValueError: the parameter groups differ from the live optimizer's (another model or optimizer setup).
    """
    groups = local_groups(canonical["param_groups"], names, where, absent)
    saved = canonical["state"]
    state: dict[int, dict[str, Any]] = {}
    for index, name in enumerate(names):
        if name in absent:
            continue
        shard = shards.get(name)
        if shard is None:
            if name in saved:
                state[index] = dict(saved[name])
            continue
        pieces = [saved.get(expert_key(name, e)) for e in shard.global_range]
        if name not in saved and all(p is None for p in pieces):
            continue  # no state yet (the optimizer had not stepped this parameter)
        if any(p is None for p in pieces):
            raise ValueError(
                f"the optimizer state at {where} lacks some experts of `{name}` (this rank holds experts "
                f"{shard.first_expert}..{shard.first_expert + shard.num_local - 1}); a checkpoint must hold every "
                "expert's state. Load a complete checkpoint."
            )
        entry = dict(saved.get(name, {}))
        for key in pieces[0]:
            entry[key] = torch.stack([p[key] for p in pieces])
        state[index] = entry
    return {"state": state, "param_groups": _indexed_groups(groups)}


def full_optimizer_to_canonical(
    state_dict: Mapping[str, Any],
    names: Sequence[str],
    shards: Mapping[str, ExpertShard],
    where: str,
    absent: Collection[str] = (),
    saved_names: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Canonical form of this rank's part of an unsharded ``optimizer.state_dict()`` (expert tensors ``[E, ...]``).

    Its state is indexed by position: ``saved_names`` (recorded by the writer) names the positions, else the live
    optimizer's ``names`` do. State of ``absent`` parameters (on meta here) is left out.
    """
    full_names = list(names if saved_names is None else saved_names)
    saved_count = sum(len(g["params"]) for g in state_dict["param_groups"])
    if saved_count != len(full_names):
        raise ValueError(
            f"the optimizer state at {where} has {saved_count} parameters but the optimizer has {len(full_names)}; "
            "state is matched to parameters by position, so the optimizer must be built the same way. Use the "
            "`configure_optimizers` the checkpoint was saved with."
        )
    state: dict[str, dict[str, Any]] = {}
    for index, entry in state_dict["state"].items():
        name = full_names[int(index)]
        if name in absent:
            continue
        shard = shards.get(name)
        if shard is None:
            state[name] = dict(entry)
            continue
        shared, per_expert = _split_entry(name, entry, shard.num_experts, "experts (the model's count)")
        state[name] = shared
        for expert in shard.global_range:
            state[expert_key(name, expert)] = {k: v[expert] for k, v in per_expert.items()}
    return {"state": state, "param_groups": _named_groups(state_dict["param_groups"], full_names)}


def canonical_optimizer_to_full(canonical: Mapping[str, Any]) -> dict[str, Any]:
    """The unsharded ``optimizer.state_dict()`` from a canonical form holding every expert (offline consolidation)."""
    names = [n for group in canonical["param_groups"] for n in group["params"]]
    saved = canonical["state"]
    experts: dict[str, dict[int, dict[str, Any]]] = {}
    for key, entry in saved.items():
        name, expert = split_key(key)
        if expert is not None:
            experts.setdefault(name, {})[expert] = entry
    state: dict[int, dict[str, Any]] = {}
    for index, name in enumerate(names):
        entry = dict(saved.get(name, {}))
        pieces = experts.get(name)
        if pieces:
            if sorted(pieces) != list(range(len(pieces))):
                raise ValueError(
                    f"the optimizer state of `{name}` has experts {sorted(pieces)[:8]}, not every expert 0..E-1; "
                    "the checkpoint is incomplete. Consolidate a complete checkpoint."
                )
            for key in pieces[0]:
                entry[key] = torch.stack([pieces[e][key] for e in range(len(pieces))])
        if entry:
            state[index] = entry
    return {"state": state, "param_groups": _indexed_groups(canonical["param_groups"])}


def _split_entry(name: str, entry: Mapping[str, Any], count: int, what: str) -> tuple[dict, dict]:
    """(shared, per-expert) values of one parameter's state; per-expert ones must lead with ``count``."""
    shared, per_expert = {}, {}
    for key, value in entry.items():
        if not isinstance(value, Tensor) or value.dim() == 0:
            shared[key] = value
        elif value.shape[0] == count:
            per_expert[key] = value
        else:
            raise NotImplementedError(
                f"the optimizer state `{key}` of expert parameter `{name}` is {tuple(value.shape)}, which does not "
                f"lead with the {count} {what}; expert state is split along dim 0. Use an optimizer whose state "
                "tensors have the parameter's leading dimension (SGD, Adam(W), Adafactor, ...)."
            )
    return shared, per_expert


def _named_groups(groups: Sequence[Mapping[str, Any]], names: Sequence[str]) -> list[dict[str, Any]]:
    return [{**g, "params": [names[int(i)] for i in g["params"]]} for g in groups]


def check_groups(
    groups: Sequence[Mapping[str, Any]], names: Sequence[str], where: str, absent: Collection[str] = ()
) -> None:
    """Raise unless the saved groups list the optimizer's parameters ``names``, in order.

    Saved parameters that are ``absent`` here (on meta: another pp rank holds them) and not in ``names`` are
    skipped, so a rank whose optimizer lists only its own parameters matches a checkpoint of the whole model.
    """
    listed = set(names)
    saved = [n for g in groups for n in g["params"] if n in listed or n not in absent]
    if saved != list(names):
        missing = [n for n in names if n not in saved]
        unexpected = [n for n in saved if n not in names]
        raise ValueError(
            f"the optimizer state at {where} was saved for other parameters: {len(missing)} of the optimizer's are "
            f"not in it {missing[:5]}, {len(unexpected)} saved ones are not in the optimizer {unexpected[:5]} "
            "(or the order differs). Optimizer state loads only into the same model and `configure_optimizers`."
        )


def local_groups(
    groups: Sequence[Mapping[str, Any]], names: Sequence[str], where: str, absent: Collection[str] = ()
) -> list[dict[str, Any]]:
    """The saved named groups cut down to the live optimizer's parameters ``names`` (checked first)."""
    check_groups(groups, names, where, absent)
    listed = set(names)
    return [{**g, "params": [n for n in g["params"] if n in listed]} for g in groups]


def merge_param_groups(per_rank: Sequence[Sequence[Mapping[str, Any]]], order: Sequence[str]) -> list[dict[str, Any]]:
    """The named groups of the unsplit model's optimizer from those of every rank (each lists what it holds).

    Group ``g`` keeps the first rank's hyper-parameters and lists every name any rank lists in its group ``g``: in
    a rank's own order when one rank lists them all (its optimizer has every parameter), else in ``order`` (the
    unsplit module's parameter order, which is what ``self.parameters()`` gives at pp = 1).

    Raises:
        ValueError: the ranks' optimizers have different numbers of parameter groups.
    """
    counts = sorted({len(groups) for groups in per_rank})
    if len(counts) > 1:
        raise ValueError(
            f"the ranks' optimizers have {counts} parameter groups; a checkpoint keyed by the unsplit model needs "
            "the same groups on every rank. Build the optimizer with the same groups on every pipeline rank (an "
            "empty group where a rank holds none of its parameters)."
        )
    position = {n: i for i, n in enumerate(order)}
    merged = []
    for g, first in enumerate(per_rank[0]):
        lists = [list(groups[g]["params"]) for groups in per_rank]
        union = {n for names in lists for n in names}
        complete = next((names for names in lists if len(names) == len(union) and set(names) == union), None)
        params = complete if complete is not None else sorted(union, key=lambda n: position.get(n, len(position)))
        merged.append({**first, "params": params})
    return merged


def _indexed_groups(groups: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Param groups with their parameters numbered consecutively, as ``torch.optim.Optimizer.state_dict`` does."""
    out, start = [], 0
    for group in groups:
        count = len(group["params"])
        out.append({**group, "params": list(range(start, start + count))})
        start += count
    return out
