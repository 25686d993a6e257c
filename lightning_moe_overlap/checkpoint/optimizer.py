"""Optimizer state between torch's index-keyed ``state_dict()`` and the name-keyed forms of :mod:`.state`.

A consolidated file holds plain ``optimizer.state_dict()`` dicts (``{"state": {3: {...}}, "param_groups":
[{"params": [0, 1, ...], ...}]}``), as an unsharded run writes them; the state-dict API and DCP key state by the
parameter's name. At pp > 1 a rank's optimizer may list every parameter of the unsplit model (the meta ones never
step) or only the ones it holds; the saved groups name every parameter (:func:`merge_param_groups`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_moe_overlap.checkpoint.state import GROUPS, STATE, unwrapped


def param_names(optimizer: torch.optim.Optimizer, module: nn.Module) -> list[str]:
    """The name in ``module`` of each parameter of ``optimizer``, in the order of its state dict's indices.

    Raises:
        ValueError: the optimizer holds a parameter that ``module`` does not have.
    """
    names = {id(p): n for n, p in module.named_parameters()}
    out: list[str] = []
    for group in unwrapped(optimizer).param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"`{type(optimizer).__name__}` holds a parameter of shape {tuple(p.shape)} that is not a parameter "
                    "of the LightningModule; checkpoints name optimizer state by parameter name. Optimize only the "
                    "module's own parameters (`self.parameters()` in `configure_optimizers`)."
                )
            out.append(names[id(p)])
    return out


def named_groups(optimizer: torch.optim.Optimizer, module: nn.Module) -> list[dict[str, Any]]:
    """The optimizer's parameter groups with their parameters by name."""
    names = iter(param_names(optimizer, module))
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [next(names) for _ in g["params"]]}
            for g in unwrapped(optimizer).param_groups]


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


def to_indexed(state: Mapping[str, Mapping[str, Any]], groups: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``optimizer.state_dict()`` form of name-keyed ``state`` whose named ``groups`` fix the indices."""
    names = [n for g in groups for n in g["params"]]
    indexed = {i: dict(state[n]) for i, n in enumerate(names) if n in state}
    out, start = [], 0
    for g in groups:
        count = len(g["params"])
        out.append({**g, "params": list(range(start, start + count))})
        start += count
    return {"state": indexed, "param_groups": out}


def indexed_to_flat(osd: Mapping[str, Any], names: Sequence[str], where: str) -> dict[str, Any]:
    """The flat name-keyed form (:mod:`.state`) of an ``optimizer.state_dict()``; ``names[i]`` names index ``i``.

    Raises:
        ValueError: the state dict has another number of parameters than ``names``.
    """
    count = sum(len(g["params"]) for g in osd["param_groups"])
    if count != len(names):
        raise ValueError(
            f"the optimizer state at {where} has {count} parameters but the optimizer has {len(names)}; a file "
            "that does not name its parameters is matched to them by position, so the optimizer must be built the "
            "same way. Use the `configure_optimizers` the checkpoint was saved with."
        )
    flat: dict[str, Any] = {}
    for index, entry in osd["state"].items():
        flat.update({f"{STATE}{names[int(index)]}.{k}": v for k, v in entry.items()})
    for group in osd["param_groups"]:
        for index in group["params"]:
            flat.update({f"{GROUPS}{names[int(index)]}.{k}": v for k, v in group.items() if k != "params"})
    return flat


def flat_to_named(flat: Mapping[str, Any], groups: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{name: {state name: value}}`` from a flat state, for the parameters the named ``groups`` list."""
    state: dict[str, dict[str, Any]] = {}
    for name in (n for g in groups for n in g["params"]):
        prefix = f"{STATE}{name}."
        entry = {k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix) and "." not in k[len(prefix) :]}
        if entry:
            state[name] = entry
    return state
