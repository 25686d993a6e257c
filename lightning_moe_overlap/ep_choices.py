"""The ep values that pass every rule on ep, for a model whose MoE blocks are known (``check`` builds it on meta).

Three rules read ep: ep divides ``dp*cp*tp`` (``ep-divides-dp-cp``), ep divides every MoE block's number of experts
(``experts-divisible-by-ep``), and with ``dispatcher="flex"`` DeepEP's group sizes (``flex-ep-size``). A suggestion
made by one rule alone can fail another (3 processes and 8 experts: ``ep=3`` divides ``dp*cp*tp=3`` but not 8), so
each candidate is run through all of them, the same functions ``check`` applies, and only those that pass are named.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

from lightning_moe_overlap._checks import divisors
from lightning_moe_overlap.config import OverlapConfig
from lightning_moe_overlap.parallel.dims import ParallelDimsError
from lightning_moe_overlap.validation import build_dims, check_model, check_world, rule_flex_ep_size, rule_sizes


def passing_ep_values(
    cfg: OverlapConfig,
    world_size: int | None,
    experts_per_block: Mapping[str, int],
    *,
    devices_per_node: int | None = None,
) -> list[int] | None:
    """Every ep for which no rule on ep fails, ascending; None when the candidates are unknown (a size other than
    ep is wrong, or neither the world size nor an MoE block bounds ep)."""
    if rule_sizes(cfg):
        return None
    dp_cp = _dp_cp(cfg, world_size)
    if dp_cp is not None:
        candidates = divisors(dp_cp)
    elif world_size is None and experts_per_block:
        candidates = divisors(math.gcd(*experts_per_block.values()))
    else:
        return None
    return [ep for ep in candidates if not _fails(replace(cfg, ep=ep), world_size, experts_per_block, dp_cp,
                                                  devices_per_node)]  # fmt: skip


def _dp_cp(cfg: OverlapConfig, world_size: int | None) -> int | None:
    """``dp*cp*tp`` (the ranks ep folds into) at ``world_size``, or None when it is unknown or the world does not fit
    ``pp*cp*tp``."""
    if world_size is None:
        return None
    try:
        dims = build_dims(replace(cfg, ep=1), world_size)
    except ParallelDimsError:
        return None
    return dims.ep_span


def _fails(
    cfg: OverlapConfig,
    world_size: int | None,
    experts_per_block: Mapping[str, int],
    dp_cp: int | None,
    devices_per_node: int | None,
) -> bool:
    found = (check_world(cfg, world_size) if world_size is not None else []) + rule_flex_ep_size(
        cfg, devices_per_node
    ) + check_model(cfg, experts_per_block, dp_cp)
    return any(p.is_error for p in found)


__all__ = ["passing_ep_values"]
