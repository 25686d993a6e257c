"""``ExpertBalance``: re-place the experts during training so that the most loaded ep rank stops setting the pace.

Every all-to-all is a barrier, so an expert-parallel step waits for the rank whose experts received the most
tokens. Every ``every_n_steps`` optimizer steps this callback sums the tokens each logical expert received since
the last re-placement over the ranks that see distinct tokens, packs the experts onto the ep ranks greedily (the
heaviest first onto the least loaded rank, DeepSeek's EPLB), and moves the rows that change rank (parameters,
gradients, optimizer state) in one exchange at the step boundary (``parallelize/expert_placer.py``). The results
are those of the default placement (docs/expert_placement.md); checkpoints stay logical. With ``redundant_experts``
the hottest experts also get replicas (``moe/replica_slots.py``).
"""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_moe_overlap._checks import is_positive_int
from lightning_moe_overlap.config import OverlapConfig
from lightning_moe_overlap.parallelize.expert_placer import PlacementReport
from lightning_moe_overlap.strategy import MoEOverlapStrategy


class ExpertBalance(Callback):
    """Re-place the experts from their routed load every ``every_n_steps`` optimizer steps.

    Args:
        every_n_steps: optimizer steps between re-placements; the tokens counted over those steps decide.
        min_gain: re-place a layer only when the balanced placement lowers its most loaded rank's tokens by more
            than this fraction (0.0: whenever it lowers them at all); a small margin avoids moves for noise.
        redundant_experts: replica slots per MoE layer (a multiple of ep), given to the experts with the most tokens
            per copy; each replica computes a share of its expert's tokens, and its weight gradient is added to the
            expert's before the optimizer step (the model trained is the one without replicas).
        within_nodes: when the ep group spans nodes, balance the ranks of each node among themselves and keep every
            expert on its node (a router limited to a few nodes keeps its bound); False balances over all ranks.
    """

    def __init__(
        self, every_n_steps: int = 100, min_gain: float = 0.02, redundant_experts: int = 0, within_nodes: bool = True
    ) -> None:
        if not is_positive_int(every_n_steps):
            raise ValueError(
                f"`ExpertBalance`: every_n_steps={every_n_steps!r} must be a positive integer (the optimizer steps "
                "between re-placements). Pass e.g. every_n_steps=100."
            )
        if isinstance(min_gain, bool) or not isinstance(min_gain, (int, float)) or not 0.0 <= min_gain < 1.0:
            raise ValueError(
                f"`ExpertBalance`: min_gain={min_gain!r} must be a number in [0, 1): the fraction by which a layer's "
                "most loaded rank must get lighter before its experts move. Pass e.g. min_gain=0.02."
            )
        if isinstance(redundant_experts, bool) or not isinstance(redundant_experts, int) or redundant_experts < 0:
            raise ValueError(
                f"`ExpertBalance`: redundant_experts={redundant_experts!r} must be a non-negative integer (replica "
                "slots per MoE layer, a multiple of ep). Pass e.g. redundant_experts=0 (none) or the ep size."
            )
        self.every_n_steps = every_n_steps
        self.min_gain = float(min_gain)
        if not isinstance(within_nodes, bool):
            raise TypeError(
                f"`ExpertBalance`: within_nodes={within_nodes!r} must be a bool: True keeps every expert on its node "
                "when ep spans nodes, False balances over all ranks."
            )
        self.redundant_experts = redundant_experts
        self.within_nodes = within_nodes
        self.reports: list[PlacementReport] = []  # every re-placement of this callback's runs
        self._strategy: MoEOverlapStrategy | None = None
        self._step = -1

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, MoEOverlapStrategy):
            raise TypeError(
                f"`ExpertBalance`: the Trainer's strategy is {type(strategy).__name__}; re-placing experts needs "
                "`MoEOverlapStrategy` (its experts are expert-parallel). Pass `strategy=MoEOverlapStrategy(ep=...)`."
            )
        others = [c for c in getattr(trainer, "callbacks", []) if isinstance(c, ExpertBalance) and c is not self]
        if others:
            raise ValueError(
                f"`ExpertBalance`: the Trainer has {len(others) + 1} `ExpertBalance` callbacks; each would re-place "
                "the same experts on its own schedule. Keep one."
            )
        errors = balance_errors(strategy.config, self.redundant_experts)
        if len(errors) == 1:
            raise errors[0]
        if errors:  # every rule broken, in one error of the first one's kind
            listed = "\n".join(f"  {i}. {err}" for i, err in enumerate(errors, 1))
            raise type(errors[0])(f"`ExpertBalance`: {len(errors)} problems:\n{listed}")

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        assert isinstance(trainer.strategy, MoEOverlapStrategy)
        self._strategy = trainer.strategy
        self._strategy.expert_placer().start_counting()
        self._step = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self._strategy is None or step == self._step:  # inside an accumulation window: no optimizer step yet
            return
        self._step = step
        if step % self.every_n_steps == 0:
            report = self._strategy.rebalance_experts(step, self.min_gain, self.redundant_experts, self.within_nodes)
            self.reports.append(report)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._strategy is not None:
            self._strategy.expert_placer().stop_counting()
        self._strategy = None


def balance_errors(config: OverlapConfig, replicas: int) -> list[Exception]:
    """The rules ``ExpertBalance`` needs of the strategy's settings (``setup`` raises the first; ``check`` reports
    them all): ep above 1, no optimizer CPU offload; with ``replicas``, a multiple of ep, ``shard="none"``, no
    ``delay_wgrad``, the torch expert backend without FP8, and a dispatcher that takes any number of slots
    (``alltoall``, ``allgather``); see docs/expert_placement.md."""
    errors: list[Exception] = []
    if config.ep == 1:
        errors.append(ValueError(
            "`ExpertBalance`: ep=1 holds every expert on every rank, so there is no rank to balance. Run with "
            "`MoEOverlapStrategy(ep=...)` above 1, or drop the callback."
        ))  # fmt: skip
    if config.optimizer_cpu_offload:
        errors.append(NotImplementedError(
            "`ExpertBalance`: optimizer_cpu_offload=True keeps host copies of the expert parameters that a "
            "re-placement does not move. Turn one of them off."
        ))  # fmt: skip
    if not replicas:
        return errors
    if replicas % config.ep:
        errors.append(ValueError(
            f"`ExpertBalance`: redundant_experts={replicas} is not a multiple of ep={config.ep}; every ep rank holds "
            f"the same number of replica slots. Pass a multiple of {config.ep}."
        ))  # fmt: skip
    unsupported = [
        (config.shard != "none", f"shard={config.shard!r} (the replicas' rows are refreshed whole)"),
        (config.delay_wgrad, "delay_wgrad=True (a replica's deferred weight gradient has no target)"),
        (config.expert_backend != "torch", f"expert_backend={config.expert_backend!r}"),
        (config.fp8 is not None, f"fp8={config.fp8!r}"),
        (config.dispatcher == "flex", "dispatcher='flex' (DeepEP's configured sizes)"),
        (config.alltoall_static, "alltoall_static=True (slots sized for E experts)"),
    ]
    found = [what for broken, what in unsupported if broken]
    if found:
        errors.append(NotImplementedError(
            f"`ExpertBalance`: redundant_experts={replicas} does not run with {', '.join(found)}; replicas need "
            "shard='none', delay_wgrad=False, expert_backend='torch' without FP8 and the 'alltoall' or 'allgather' "
            "dispatcher. Change those settings, or re-place without replicas (redundant_experts=0)."
        ))  # fmt: skip
    return errors


def placement_metrics(new: list[PlacementReport], latest: PlacementReport | None) -> dict[str, float]:
    """What ``MoEMonitor`` logs of the re-placements at each logged step: ``new``, those since the last logged step,
    summed (``moe/placement/moved_experts`` over this rank's blocks, this rank's ``bytes_sent`` and ``seconds``; 0
    when none), and per block ``moe/<block>/rank_imbalance_before`` / ``_after`` of the ``latest`` re-placement (none
    before the first)."""
    if latest is None:
        return {}
    out: dict[str, float] = {}
    for layer in latest.layers:
        block = layer.name.rpartition(".")[0] or layer.name
        out[f"moe/{block}/rank_imbalance_before"] = layer.imbalance_before
        out[f"moe/{block}/rank_imbalance_after"] = layer.imbalance_after
    out["moe/placement/moved_experts"] = float(sum(layer.moved_experts for r in new for layer in r.layers))
    out["moe/placement/bytes_sent"] = float(sum(r.move.bytes_sent for r in new))
    out["moe/placement/seconds"] = sum(r.move.seconds for r in new)
    return {k: v for k, v in out.items() if not math.isnan(v)}
