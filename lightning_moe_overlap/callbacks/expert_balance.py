"""``ExpertBalance``: re-place the experts during training so that the most loaded ep rank stops setting the pace.

Every all-to-all is a barrier, so an expert-parallel step waits for the rank whose experts received the most
tokens. Every ``every_n_steps`` optimizer steps this callback sums the tokens each logical expert received since
the last re-placement over the ranks that see distinct tokens, packs the experts onto the ep ranks greedily (the
heaviest first onto the least loaded rank, DeepSeek's EPLB), and moves the rows that change rank (parameters,
gradients, optimizer state) in one exchange at the step boundary (``parallelize/expert_placer.py``). The results
are those of the default placement (docs/expert_placement.md); checkpoints stay logical.
"""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_moe_overlap._checks import is_positive_int
from lightning_moe_overlap.parallelize.expert_placer import PlacementReport
from lightning_moe_overlap.strategy import MoEOverlapStrategy


class ExpertBalance(Callback):
    """Re-place the experts from their routed load every ``every_n_steps`` optimizer steps.

    Args:
        every_n_steps: optimizer steps between re-placements; the tokens counted over those steps decide.
        min_gain: re-place a layer only when the balanced placement lowers its most loaded rank's tokens by more
            than this fraction (0.0: whenever it lowers them at all); a small margin avoids moves for noise.
    """

    def __init__(self, every_n_steps: int = 100, min_gain: float = 0.02) -> None:
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
        self.every_n_steps = every_n_steps
        self.min_gain = float(min_gain)
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
        if strategy.config.ep == 1:
            raise ValueError(
                "`ExpertBalance`: ep=1 holds every expert on every rank, so there is no rank to balance. Run with "
                "`MoEOverlapStrategy(ep=...)` above 1, or drop the callback."
            )
        if strategy.config.optimizer_cpu_offload:
            raise NotImplementedError(
                "`ExpertBalance`: optimizer_cpu_offload=True keeps host copies of the expert parameters that a "
                "re-placement does not move. Turn one of them off."
            )

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
            self.reports.append(self._strategy.rebalance_experts(step, self.min_gain))

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


def placement_metrics(reports: list[PlacementReport]) -> dict[str, float]:
    """The metrics of the latest of ``reports`` (what ``MoEMonitor`` logs after a re-placement): per block
    ``moe/<block>/rank_imbalance_before`` / ``_after`` and, summed over blocks, ``moe/placement/moved_experts``,
    with this rank's ``moe/placement/bytes_sent`` and ``moe/placement/seconds``."""
    if not reports:
        return {}
    report = reports[-1]
    out: dict[str, float] = {}
    for layer in report.layers:
        block = layer.name.rpartition(".")[0] or layer.name
        out[f"moe/{block}/rank_imbalance_before"] = layer.imbalance_before
        out[f"moe/{block}/rank_imbalance_after"] = layer.imbalance_after
    out["moe/placement/moved_experts"] = float(sum(layer.moved_experts for layer in report.layers))
    out["moe/placement/bytes_sent"] = float(report.move.bytes_sent)
    out["moe/placement/seconds"] = report.move.seconds
    return {k: v for k, v in out.items() if not math.isnan(v)}
