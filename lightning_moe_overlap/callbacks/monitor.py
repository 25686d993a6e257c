"""``MoEMonitor``: routing balance and hidden communication in the user's own logger (docs/monitoring.md).

Off unless listed in ``trainer.callbacks``. On the hot path it only adds on the device (tokens per expert,
dropped assignments, router losses; see ``moe/stats.py``) and, at each comm point, reads the host clock (CPU) or
records CUDA events; nothing is copied to the host. At each step Lightning sends to the loggers
(``log_every_n_steps``) it reduces the sums over the ranks that see distinct tokens with one all-reduce, reads
them with one device-to-host copy and logs, through ``LightningModule.log``:

- per MoE block ``moe/<block>/...`` and over all blocks ``moe/...``: ``aux_loss``, ``z_loss`` (mean per forward;
  summed over blocks), ``tokens_per_expert_min`` / ``_max`` / ``_cv`` (per step, all ranks), ``imbalance``
  (max / mean tokens per expert), ``dropped_fraction`` (under the block's capacity factor, or the monitor's),
  ``expert_bias_norm``;
- per step, averaged over the interval and the ranks: ``moe/a2a_exposed_ms`` (the all-to-all time nothing hid),
  ``moe/a2a_total_ms`` (in flight), ``moe/a2a_hidden_fraction`` (``1 - exposed / total``),
  ``moe/microbatches``, ``moe/tokens_per_s`` (all ranks' tokens over the training-step time);
- per block of expert-parallel experts, ``moe/<block>/rank_imbalance``: the most loaded ep rank's tokens over the
  mean rank's, under the placement the interval's last step ran with; once ``ExpertBalance`` has re-placed, the
  latest re-placement's ``rank_imbalance_before`` / ``_after``, and at every logged step the interval's
  ``moe/placement/moved_experts`` / ``bytes_sent`` / ``seconds`` (0 without a re-placement;
  ``callbacks/expert_balance.py``);
- at ``pp > 1`` the block sums and bias norms are also summed over the pp group: every rank logs every block;
- a tokens-per-expert histogram per block to loggers whose ``experiment`` has ``add_histogram_raw`` /
  ``add_histogram`` (TensorBoard), on global rank 0.

The progress bar shows ``moe/tokens_per_s`` and ``moe/a2a_hidden_fraction``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_moe_overlap._compat import lightning as pl_compat
from lightning_moe_overlap.callbacks.expert_balance import placement_metrics
from lightning_moe_overlap.moe.capacity import validate_capacity
from lightning_moe_overlap.moe.ep import ExpertParallelExperts
from lightning_moe_overlap.moe.placement import ExpertPlacement
from lightning_moe_overlap.moe.stats import BLOCK_SCALARS, RoutingStats, Summary, summarize
from lightning_moe_overlap.overlap.event_timer import EventCommTimer
from lightning_moe_overlap.overlap.observers import CommTimer
from lightning_moe_overlap.overlap.runtime import CommRuntime, ObserverHandle
from lightning_moe_overlap.strategy import MoEOverlapStrategy

PROGRESS_BAR = ("moe/tokens_per_s", "moe/a2a_hidden_fraction")


class MoEMonitor(Callback):
    """Log MoE routing statistics and the hidden all-to-all time of each logging interval.

    Args:
        capacity_factor: capacity factor for the ``dropped_fraction`` of blocks without one of their own (what a
            dropless run would drop under it); blocks built with a capacity factor report their own drops.
        histogram: send a tokens-per-expert histogram per block to loggers that take histograms.
        progress_bar: show tokens/s and the hidden fraction in the progress bar.
    """

    def __init__(self, capacity_factor: float | None = None, histogram: bool = True, progress_bar: bool = True) -> None:
        validate_capacity(capacity_factor, "probs", owner="`MoEMonitor`")
        self.capacity_factor = capacity_factor
        self.histogram = histogram
        self.progress_bar = progress_bar
        self.stats: RoutingStats | None = None
        self.last: dict[str, float] = {}  # the metrics logged last (also in trainer.callback_metrics)
        self._timer: CommTimer | None = None
        self._attached: ObserverHandle | None = None  # the timer attached to the strategy's comm runtime
        self._steps = 0
        self._step_s = 0.0
        self._step_start: float | None = None
        self._placed: dict[str, ExpertParallelExperts] = {}  # block name -> its expert-parallel experts (ep > 1)
        self._ran_with: dict[str, ExpertPlacement] = {}  # block name -> the placement the last step ran with
        self._shares: dict[ExpertPlacement, torch.Tensor] = {}  # each placement's share matrix on the device
        self._reports_logged = 0  # the re-placements already logged

    # -- attach / detach -------------------------------------------------------------------------------------------
    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.stats = RoutingStats(pl_module, capacity_factor=self.capacity_factor)
        self._placed = {
            name.rpartition(".")[0] or name: m
            for name, m in pl_module.named_modules()
            if isinstance(m, ExpertParallelExperts) and m.placement.ep > 1
        }
        runtime = getattr(trainer.strategy, "runtime", None)
        if isinstance(runtime, CommRuntime):
            self._timer = EventCommTimer() if pl_module.device.type == "cuda" else CommTimer()
            self._attached = runtime.attach(self._timer)
        self._reset_interval()

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._detach()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._detach()

    def _detach(self) -> None:
        if self.stats is not None:
            self.stats.remove()
        if self._attached is not None:
            self._attached.remove()
        self._attached = self._timer = None

    # -- per step --------------------------------------------------------------------------------------------------
    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_start = time.perf_counter()
        self._ran_with = {block: module.placement for block, module in self._placed.items()}

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.stats is None or self._step_start is None:
            return
        logging = pl_compat.should_update_logs(trainer)
        if logging and pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)  # NOTE: D2H sync (once per logging interval: the step's time)
        self._steps += 1
        self._step_s += time.perf_counter() - self._step_start
        self._step_start = None
        if not logging:
            return
        summary = self._read(trainer, pl_module)
        for name, value in summary.metrics.items():
            prog_bar = self.progress_bar and name in PROGRESS_BAR
            pl_module.log(name, value, on_step=True, on_epoch=False, prog_bar=prog_bar)
        self.last = summary.metrics
        if self.histogram and trainer.is_global_zero:
            _log_histograms(trainer, summary, pl_compat.logging_step(trainer))  # the scalars' step

    # -- one read per interval -------------------------------------------------------------------------------------
    def _read(self, trainer: Trainer, pl_module: LightningModule) -> Summary:
        assert self.stats is not None
        device = pl_module.device
        packed, layout = self.stats.pack(device)
        times = self._timer.reset() if self._timer is not None else None
        timing = torch.tensor(
            [self._step_s, times.blocked_s if times else 0.0, times.in_flight_s if times else 0.0, 1.0],
            dtype=torch.float64,
            device=device,
        )
        group = _token_group(trainer)
        if group is not False:
            reduced = torch.cat([packed, timing])
            dist.all_reduce(reduced, group=group)  # one collective per logging interval
            packed, timing = reduced[: packed.numel()], reduced[packed.numel() :]
        norms = self.stats.bias_norms(device)
        imbalance = self._rank_imbalance(packed, layout, device)  # the held blocks', from all their ranks' counts
        stages = _stage_group(trainer)
        if stages is not None:  # pp > 1: each block's sums and bias are on the stage that holds it, zeros elsewhere
            reduced = torch.cat([packed, norms, imbalance])
            dist.all_reduce(reduced, group=stages)  # a second collective per logging interval, at pp > 1 only
            size = packed.numel() + norms.numel()
            packed, norms, imbalance = reduced[: packed.numel()], reduced[packed.numel() : size], reduced[size:]
        names = [b.name for b in self.stats.blocks]
        summary = summarize(names, packed, layout, norms, steps=self._steps)
        if self._expert_parallel(trainer):  # every block's, on every rank (at pp > 1 too)
            values = imbalance.tolist()  # NOTE: D2H sync (once per logging interval)
            summary.metrics.update({f"moe/{name}/rank_imbalance": v for name, v in zip(names, values)})
        step_s, blocked_s, in_flight_s, ranks = timing.tolist()  # NOTE: D2H sync (once per logging interval)
        steps = max(self._steps, 1)
        metrics = summary.metrics
        metrics["moe/microbatches"] = float(_num_microbatches(trainer))
        if times is not None:
            metrics["moe/a2a_exposed_ms"] = 1e3 * blocked_s / ranks / steps
            metrics["moe/a2a_total_ms"] = 1e3 * in_flight_s / ranks / steps
            metrics["moe/a2a_hidden_fraction"] = 1.0 - blocked_s / in_flight_s if in_flight_s > 0 else 0.0
        mean_step_s = step_s / ranks
        if mean_step_s > 0 and summary.tokens:
            metrics["moe/tokens_per_s"] = summary.tokens / mean_step_s
        metrics.update(self._placement(trainer, summary))
        self._reset_interval()
        return summary

    def _rank_imbalance(self, packed: torch.Tensor, layout: list[dict[str, int]], device: torch.device) -> torch.Tensor:
        """``[blocks]`` on the device: per block held here with expert-parallel experts, max / mean tokens per ep
        rank under the placement its last step ran with, from the counts in ``packed`` (summed over the ranks that
        see distinct tokens); 0 for the others. No host read."""
        out = torch.zeros(len(layout), dtype=torch.float64, device=device)
        offset = 0
        for index, (block, item) in enumerate(zip(self.stats.blocks if self.stats else [], layout)):
            experts = item["experts"]
            placement = self._ran_with.get(block.name)
            if placement is not None:
                if placement not in self._shares:  # built once per placement (a host-to-device copy)
                    self._shares[placement] = placement.share_matrix(device)
                loads = packed[offset : offset + experts].to(torch.float64) @ self._shares[placement]
                mean = loads.mean()
                out[index] = torch.where(mean > 0, loads.max() / mean.clamp_min(1e-30), 0.0)
            offset += experts + BLOCK_SCALARS
        return out

    @staticmethod
    def _expert_parallel(trainer: Trainer) -> bool:
        strategy = trainer.strategy
        return isinstance(strategy, MoEOverlapStrategy) and strategy.dims.ep > 1

    def _placement(self, trainer: Trainer, summary: Summary) -> dict[str, float]:
        """The re-placements since the last logged step (``placement_metrics``; at ``pp > 1`` this stage's)."""
        out: dict[str, float] = {}
        prepared = trainer.strategy.prepared if isinstance(trainer.strategy, MoEOverlapStrategy) else None
        if prepared is not None and prepared.placer is not None and self._placed:
            reports = prepared.placer.reports
            out.update(placement_metrics(reports[self._reports_logged :], reports[-1] if reports else None))
            self._reports_logged = len(reports)
        return out

    def _reset_interval(self) -> None:
        self._steps = 0
        self._step_s = 0.0


def _token_group(trainer: Trainer) -> Any:
    """The group whose ranks see distinct tokens (dp x cp x tp of this package's strategy, else the world); False when
    there is nothing to reduce."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    strategy = trainer.strategy
    return strategy.parallel_groups.dp_cp_tp if isinstance(strategy, MoEOverlapStrategy) else None


def _stage_group(trainer: Trainer) -> Any:
    """The pp group of this package's strategy at ``pp > 1`` (its ranks hold different MoE blocks), else None."""
    strategy = trainer.strategy
    if not isinstance(strategy, MoEOverlapStrategy) or strategy.dims.pp == 1:
        return None
    return strategy.parallel_groups.pp


def _num_microbatches(trainer: Trainer) -> int:
    config = getattr(trainer.strategy, "config", None)
    return int(getattr(config, "num_microbatches", 1))


def _log_histograms(trainer: Trainer, summary: Summary, step: int) -> None:
    """Tokens per expert as a histogram over the expert index (bucket ``e`` holds expert ``e``'s tokens)."""
    for logger in trainer.loggers:
        experiment = getattr(logger, "experiment", None)
        raw = getattr(experiment, "add_histogram_raw", None)
        plain = getattr(experiment, "add_histogram", None)
        if raw is None and plain is None:
            continue
        for name, counts in summary.tokens_per_expert.items():
            tag = f"moe/{name}/tokens_per_expert"
            if raw is not None:
                total = sum(counts)
                raw(
                    tag,
                    min=0.0,
                    max=float(len(counts) - 1),
                    num=total,
                    sum=sum(e * c for e, c in enumerate(counts)),
                    sum_squares=sum(e * e * c for e, c in enumerate(counts)),
                    bucket_limits=[e + 0.5 for e in range(len(counts))],
                    bucket_counts=counts,
                    global_step=step,
                )
            else:
                plain(tag, torch.tensor(counts), global_step=step)
