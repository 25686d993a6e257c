"""Routing statistics accumulated on the device: tokens per expert, dropped assignments, router losses.

:class:`RoutingStats` hooks every MoE block of a model (found by the experts adapters) and, in training forwards
only (not in eval, not in a checkpoint's recompute inside backward), adds up on the device:

- ``counts_E``: the (token, choice) assignments the router sent to each expert, before any capacity drop (read at
  the router's output ``(logits, weights_TK, indices_TK)``, this package's ``TopKRouter`` and HF v5 routers; at the
  experts' input when the block has no such router);
- ``dropped``: the assignments a capacity factor drops: ``sum_e max(0, count_e - capacity)`` per call with
  ``capacity = ceil(T*K/E * factor)``, exactly what ``drop_over_capacity`` drops whatever the policy. The factor
  is the block's own (``ExpertParallelExperts`` or ``MoELayer``), else the one given to :class:`RoutingStats`;
- the router's load-balancing and z losses (``TopKRouter.metrics``), summed over the forwards that computed them
  (a router without an aux-loss or z-loss coefficient computes none, and none is reported for its block).

Nothing is read back to the host here: :meth:`RoutingStats.pack` returns one float64 vector (reduce it over the
ranks with one collective) and :func:`summarize` turns it into numbers with a single device-to-host copy. At
``pp > 1`` a block's sums are on the ranks of the stage that holds it, zeros elsewhere: sum them over the pp group
too. Training forwards are counted as the expert-bias counters count them (``moe/router.py``): not in backward,
not inside ``not_counted`` (a recomputation, torch's pipeline metadata inference), per thread.

Shape legend: T tokens of one call, K top-k, E experts, L MoE blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_moe_overlap.moe.adapters import find_experts
from lightning_moe_overlap.moe.ep import ExpertParallelExperts
from lightning_moe_overlap.moe.router import TopKRouter, _in_training_forward

BIAS_NAMES = ("expert_bias", "e_score_correction_bias")  # this package's TopKRouter, HF DeepSeek-V3 style routers
BLOCK_SCALARS = 8  # the numbers after each block's counts in `RoutingStats.pack`


@dataclass
class BlockStats:
    """The device-side sums of one MoE block since the last :meth:`RoutingStats.pack`."""

    name: str
    num_experts: int
    capacity_factor: float | None
    router: nn.Module | None
    counts_E: Tensor | None = None
    dropped: Tensor | None = None
    aux_loss: Tensor | None = None
    z_loss: Tensor | None = None
    forwards: int = 0  # calls counted (host int: no sync)
    tokens: int = 0  # tokens routed in the calls counted (host int, from shapes)
    aux_forwards: int = 0  # forwards that computed a load-balancing loss
    z_forwards: int = 0  # forwards that computed a z-loss
    handles: list[RemovableHandle] = field(default_factory=list)

    def add_routing(self, indices_TK: Tensor, factor: float | None) -> None:
        with torch.no_grad():
            flat = indices_TK.reshape(-1).long()
            valid = (flat >= 0) & (flat < self.num_experts)
            counts_E = torch.zeros(self.num_experts + 1, dtype=torch.int64, device=flat.device)
            counts_E.index_add_(0, torch.where(valid, flat, self.num_experts), torch.ones_like(flat))
            counts_E = counts_E[: self.num_experts]
            self.counts_E = counts_E if self.counts_E is None else self.counts_E + counts_E
            if factor is not None:
                tokens, top_k = indices_TK.reshape(-1, indices_TK.shape[-1]).shape
                capacity = math.ceil(tokens * top_k / self.num_experts * factor)
                dropped = (counts_E - capacity).clamp(min=0).sum()
                self.dropped = dropped if self.dropped is None else self.dropped + dropped
            self.forwards += 1
            self.tokens += indices_TK.reshape(-1, indices_TK.shape[-1]).shape[0]

    def add_losses(self, metrics: dict[str, Tensor]) -> None:
        aux, z = metrics.get("load_balancing_loss"), metrics.get("z_loss")
        if aux is not None:
            self.aux_loss = aux.detach().double() if self.aux_loss is None else self.aux_loss + aux.detach().double()
            self.aux_forwards += 1
        if z is not None:
            self.z_loss = z.detach().double() if self.z_loss is None else self.z_loss + z.detach().double()
            self.z_forwards += 1

    def bias(self) -> Tensor | None:
        for name in BIAS_NAMES:
            value = getattr(self.router, name, None) if self.router is not None else None
            if isinstance(value, Tensor):
                return value
        return None


class RoutingStats:
    """Hooks the MoE blocks of ``model`` and accumulates their routing statistics on the device.

    Args:
        model: the model (before or after the strategy made its experts expert-parallel).
        capacity_factor: the factor for the dropped fraction of blocks without their own (a what-if for dropless
            runs); ``None``: those blocks report no dropped fraction.
    """

    def __init__(self, model: nn.Module, capacity_factor: float | None = None) -> None:
        self.blocks: list[BlockStats] = []
        for name, module, parent, num_experts in _experts_modules(model):
            own = getattr(module, "capacity_factor", None) or getattr(parent, "capacity_factor", None)
            factor = own if own is not None else capacity_factor
            router = getattr(parent, "gate", None)
            router = router if isinstance(router, nn.Module) else None
            block = BlockStats(name.rpartition(".")[0] or name, num_experts, factor, router)
            self._hook(block, module)
            self.blocks.append(block)

    def _hook(self, block: BlockStats, experts: nn.Module) -> None:
        def counted(module: nn.Module) -> bool:
            return module.training and _in_training_forward()

        def after_router(module: nn.Module, args: Any, output: Any) -> None:
            if not counted(module):
                return
            if isinstance(module, TopKRouter) and torch.is_grad_enabled():
                block.add_losses(module.metrics)
            if _routing_indices(output) is not None:
                block.add_routing(output[2], block.capacity_factor)

        def before_experts(module: nn.Module, args: Any) -> None:
            if counted(module) and len(args) >= 2 and isinstance(args[1], Tensor):
                block.add_routing(args[1], block.capacity_factor)

        uses_router = block.router is not None and _returns_indices(block.router)
        if block.router is not None:
            block.handles.append(block.router.register_forward_hook(after_router))
        if not uses_router:
            block.handles.append(experts.register_forward_pre_hook(before_experts))

    def remove(self) -> None:
        """Remove every hook."""
        for block in self.blocks:
            for handle in block.handles:
                handle.remove()
            block.handles.clear()

    # -- reading -----------------------------------------------------------------------------------------------------
    def pack(self, device: torch.device) -> tuple[Tensor, list[dict[str, int]]]:
        """Every block's sums as one float64 vector on ``device`` and its layout; then zero the sums.

        Per block: ``E`` counts, then ``BLOCK_SCALARS``: dropped, assignments, aux-loss sum, z-loss sum, the counts
        of forwards (calls, calls with an aux loss, calls with a z-loss) and tokens. Sums over ranks stay meaningful (add the vectors of all ranks).
        """
        parts: list[Tensor] = []
        layout: list[dict[str, int]] = []
        for b in self.blocks:
            zero = torch.zeros((), dtype=torch.float64, device=device)
            counts = b.counts_E.to(device, torch.float64) if b.counts_E is not None else zero.new_zeros(b.num_experts)
            scalars = [
                b.dropped.to(device, torch.float64) if b.dropped is not None else zero,
                counts.sum(),
                b.aux_loss.to(device) if b.aux_loss is not None else zero,
                b.z_loss.to(device) if b.z_loss is not None else zero,
                zero + b.forwards,
                zero + b.aux_forwards,
                zero + b.z_forwards,
                zero + b.tokens,
            ]
            parts += [counts, torch.stack(scalars)]
            layout.append({"experts": b.num_experts, "capacity": int(b.capacity_factor is not None)})
            b.counts_E = b.dropped = b.aux_loss = b.z_loss = None
            b.forwards = b.aux_forwards = b.z_forwards = b.tokens = 0
        if not parts:
            return torch.zeros(0, dtype=torch.float64, device=device), layout
        return torch.cat(parts), layout

    def bias_norms(self, device: torch.device) -> Tensor:
        """The L2 norm of each block's expert bias, ``[L]`` float64 on ``device``: NaN for blocks without one, 0 for
        blocks another pipeline stage holds (their bias is on the meta device), so that a sum over the pp group
        gives every block's norm."""
        norms = []
        for b in self.blocks:
            bias = b.bias()
            if bias is None:
                norms.append(torch.full((), math.nan, dtype=torch.float64, device=device))
            elif bias.is_meta:
                norms.append(torch.zeros((), dtype=torch.float64, device=device))
            else:
                norms.append(torch.linalg.vector_norm(bias.detach().to(device, torch.float64)))
        return torch.stack(norms) if norms else torch.zeros(0, dtype=torch.float64, device=device)


@dataclass(frozen=True)
class Summary:
    """What :func:`summarize` read: the metrics, each block's tokens per expert per step, the first block's tokens."""

    metrics: dict[str, float]
    tokens_per_expert: dict[str, list[float]]
    tokens: float


def summarize(
    names: list[str], packed: Tensor, layout: list[dict[str, int]], bias_norms: Tensor, *, steps: int
) -> Summary:
    """Metrics from a packed vector (summed over the ranks that see distinct tokens) of ``steps`` optimizer steps.

    ``.../tokens_per_expert_*`` are per step (all ranks' tokens), ``imbalance`` is ``max / mean`` of the tokens
    per expert, ``cv`` their standard deviation over the mean, losses are the mean per forward that computed them
    (blocks that computed none report none, and the totals are left out when no block computed one).
    """
    values = torch.cat([packed, bias_norms]).tolist()  # NOTE: D2H sync (once per logging interval)
    out: dict[str, float] = {}
    offset = 0
    total = {"dropped": 0.0, "assignments": 0.0}
    losses: dict[str, float] = {}  # the totals over the blocks that computed each loss
    imbalances: list[float] = []
    histograms: dict[str, list[float]] = {}
    first_tokens = 0.0
    has_dropped = False
    for i, (name, item) in enumerate(zip(names, layout)):
        e = item["experts"]
        counts = values[offset : offset + e]
        scalars = values[offset + e : offset + e + BLOCK_SCALARS]
        dropped, assignments, aux, z, _, aux_forwards, z_forwards, tokens = scalars
        offset += e + BLOCK_SCALARS
        if i == 0:
            first_tokens = tokens
        per_step = [c / max(steps, 1) for c in counts]
        histograms[name] = per_step
        mean = sum(per_step) / e
        std = math.sqrt(sum((c - mean) ** 2 for c in per_step) / e)
        prefix = f"moe/{name}"
        out[f"{prefix}/tokens_per_expert_min"] = min(per_step)
        out[f"{prefix}/tokens_per_expert_max"] = max(per_step)
        out[f"{prefix}/tokens_per_expert_cv"] = std / mean if mean > 0 else 0.0
        out[f"{prefix}/imbalance"] = max(per_step) / mean if mean > 0 else 0.0
        imbalances.append(out[f"{prefix}/imbalance"])
        for loss, loss_sum, forwards in (("aux_loss", aux, aux_forwards), ("z_loss", z, z_forwards)):
            if forwards:
                out[f"{prefix}/{loss}"] = loss_sum / forwards
                losses[loss] = losses.get(loss, 0.0) + loss_sum / forwards
        if item["capacity"] and assignments:
            out[f"{prefix}/dropped_fraction"] = dropped / assignments
            total["dropped"] += dropped
            total["assignments"] += assignments
            has_dropped = True
        norm = values[len(packed) + i]
        if not math.isnan(norm):
            out[f"{prefix}/expert_bias_norm"] = norm
    if imbalances:
        out["moe/imbalance"] = sum(imbalances) / len(imbalances)
        out["moe/imbalance_max"] = max(imbalances)
    out.update({f"moe/{loss}": value for loss, value in losses.items()})
    if has_dropped and total["assignments"]:
        out["moe/dropped_fraction"] = total["dropped"] / total["assignments"]
    norms = [n for n in values[len(packed) :] if not math.isnan(n)]
    if norms:
        out["moe/expert_bias_norm"] = math.sqrt(sum(n * n for n in norms))
    return Summary(out, histograms, first_tokens)


def _experts_modules(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module, int]]:
    """``(qualified name, experts module, parent, experts)`` of every expert-parallel or recognised experts module,
    in model order."""
    parents = {id(child): parent for parent in model.modules() for child in parent.children()}
    recognised = {id(f.module): f.num_experts for f in find_experts(model).values()}
    out = []
    for name, module in model.named_modules():
        if isinstance(module, ExpertParallelExperts):
            out.append((name, module, parents[id(module)], module.num_experts))
        elif id(module) in recognised:
            out.append((name, module, parents[id(module)], recognised[id(module)]))
    return out


def _returns_indices(router: nn.Module) -> bool:
    """Routers of this package and of HF v5 return ``(logits, weights_TK, indices_TK)``."""
    return isinstance(router, TopKRouter) or hasattr(router, "top_k")


def _routing_indices(output: Any) -> Tensor | None:
    if isinstance(output, tuple) and len(output) == 3 and isinstance(output[2], Tensor):
        if not output[2].is_floating_point():
            return output[2]
    return None

