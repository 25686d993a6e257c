"""Checks that a checkpoint fits the live model and optimizers, made before any tensor is read.

Every check compares names and *global* shapes (a ``DTensor``'s unsharded one), so it holds whatever layout wrote
the checkpoint and whatever layout reads it. Each error names the values, the rule and the fix.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch

Shapes = Mapping[str, torch.Size | None]


def check_expert_counts(saved: Shapes, experts: Mapping[str, int], where: str) -> None:
    """Raise when a per-expert tensor was saved with another number of experts (dim 0) than the model has.

    Raises:
        ValueError: the counts differ (names the tensor, both counts, the rule and the fix).
    """
    for name, count in experts.items():
        shape = saved.get(name)
        if shape is not None and len(shape) > 0 and shape[0] != count:
            raise ValueError(
                f"the checkpoint at {where} holds {shape[0]} experts for `{name}` but the model has {count}. A "
                "checkpoint loads at any ep that divides its number of experts, but the number of experts itself "
                f"must match. Load it into a model built with {shape[0]} experts."
            )


def check_keys(saved: Shapes, wanted: Shapes, where: str, *, strict: bool) -> None:
    """Raise when the saved keys and shapes do not fit the model (``None`` shape: not a tensor, not compared).

    Raises:
        ValueError: a key the model needs is missing or a saved key is unknown to it (``strict``), or a shape
            differs (always).
    """
    missing = [k for k in wanted if k not in saved]
    unexpected = [k for k in saved if k not in wanted]
    shapes = [
        f"{k}: saved {tuple(saved[k])}, model {tuple(wanted[k])}"
        for k in wanted
        if k in saved and saved[k] is not None and wanted[k] is not None and tuple(saved[k]) != tuple(wanted[k])
    ]
    if shapes:
        raise ValueError(
            f"the checkpoint at {where} does not fit the model: {len(shapes)} tensors differ in shape "
            f"({'; '.join(shapes[:3])}). A checkpoint loads only into the model it was saved from (any ep size). "
            "Build the model with the configuration it was saved with."
        )
    if strict and (missing or unexpected):
        raise ValueError(
            f"the checkpoint at {where} was saved from a different model: {len(missing)} keys of the model are not "
            f"in it {missing[:5]}, {len(unexpected)} saved keys are not in the model {unexpected[:5]}. A "
            "checkpoint loads only into the model it was saved from (any ep size). Build that model, or set "
            "`strict_loading = False` on the LightningModule to load the keys both have."
        )


def check_optimizer(saved: Collection[str], listed: Collection[str], held: Collection[str], where: str) -> None:
    """Raise unless the optimizer state was saved for the parameters the live optimizer lists.

    Args:
        saved: parameter names the checkpoint has optimizer entries for.
        listed: parameter names of the live optimizer.
        held: parameter names of the model held here (not on meta): a saved one the optimizer does not list is
            another ``configure_optimizers``.

    Raises:
        ValueError: the parameters differ (names them, the rule and the fix).
    """
    saved, listed = set(saved), set(listed)
    missing = sorted(listed - saved)
    unexpected = sorted((saved - listed) & set(held))
    if missing or unexpected:
        raise ValueError(
            f"the optimizer state at {where} was saved for other parameters: {len(missing)} of the optimizer's are "
            f"not in it {missing[:5]}, {len(unexpected)} saved ones are not in the optimizer {unexpected[:5]}. "
            "Optimizer state loads only into the same model and `configure_optimizers`."
        )


def check_state_names(saved: Collection[str], wanted: Collection[str], where: str) -> None:
    """Raise when the live optimizer keeps state the checkpoint lacks (another optimizer class).

    Raises:
        ValueError: names the missing state entries, the rule and the fix.
    """
    missing = sorted(set(wanted) - set(saved))
    if missing:
        raise ValueError(
            f"the optimizer state at {where} lacks {len(missing)} entries the optimizer keeps {missing[:4]}: it was "
            "saved by another optimizer. Optimizer state loads only into the `configure_optimizers` it was saved "
            "with."
        )


def agree(error: Exception | None) -> None:
    """Raise the first rank's error on every rank (or nothing when no rank has one): no rank is left waiting."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if error is not None:
            raise error
        return
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if error is None else (type(error), str(error)))
    for rank, found in enumerate(errors):
        if found is not None:
            kind, message = found
            if error is not None:
                raise error
            raise kind(f"{message} (raised on rank {rank})")
