"""``OverlapTimeline``: the timeline of one training step on every rank, as a Chrome trace and a PNG.

For the step whose ``trainer.global_step`` is ``step`` when it starts, a
:class:`~lightning_moe_overlap.overlap.timeline.TimelineRecorder` is attached to the strategy's comm runtime; at
the end of the step every rank's records are gathered (one ``all_gather_object``) and global rank 0 writes
``<dirpath>/step<N>.trace.json`` (Perfetto / ``chrome://tracing``) and ``<dirpath>/step<N>.png`` (matplotlib).
Other steps pay one emptiness test per comm point. The CLI adds it with ``--trace_step N``.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_moe_overlap.overlap.runtime import CommRuntime, ObserverHandle
from lightning_moe_overlap.overlap.timeline import StepTimeline, TimelineRecorder, write_chrome_trace
from lightning_moe_overlap.callbacks.timeline_plot import DEFAULT_TITLE, PLOT_HINT, plot_timelines


class OverlapTimeline(Callback):
    """Write the timeline of training step ``step`` (see the module docstring).

    Args:
        step: the ``global_step`` of the traced step (0 is the first; later steps show the steady state).
        dirpath: where to write; ``None``: ``<trainer.default_root_dir>/timeline``.
        png: ``True``: also draw the PNG (needs matplotlib); ``False``: the trace only; ``None``: the PNG when
            matplotlib is installed.

    Raises:
        ValueError: ``step`` is negative or not an int.
        ImportError: ``png=True`` without matplotlib.
    """

    def __init__(self, step: int = 2, dirpath: str | None = None, png: bool | None = None) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"`OverlapTimeline(step={step!r})`: the step must be an int >= 0 (a `global_step`).")
        has_matplotlib = importlib.util.find_spec("matplotlib") is not None
        if png and not has_matplotlib:
            raise ImportError(f"`OverlapTimeline(png=True)` needs matplotlib, which is not installed. {PLOT_HINT}")
        self.step = step
        self.dirpath = dirpath
        self.png = has_matplotlib if png is None else png
        self._png_requested = png
        self.written: list[Path] = []  # on global rank 0, once the step ran
        self._recorder: TimelineRecorder | None = None
        self._attached: ObserverHandle | None = None

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        runtime = getattr(trainer.strategy, "runtime", None)
        if trainer.global_step != self.step or not isinstance(runtime, CommRuntime) or self.written:
            return
        self._recorder = TimelineRecorder(rank=trainer.global_rank)
        self._attached = runtime.attach(self._recorder)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        recorder, attached = self._recorder, self._attached
        if recorder is None or attached is None:
            return
        attached.remove()
        self._recorder = self._attached = None
        mine = recorder.timeline().to_dict()
        gathered: list[Any] = [mine]
        if dist.is_available() and dist.is_initialized():
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
        if trainer.is_global_zero:
            timelines = [StepTimeline.from_dict(d) for d in gathered]
            folder = Path(self.dirpath or Path(trainer.default_root_dir) / "timeline")
            self.written.append(write_chrome_trace(folder / f"step{self.step}.trace.json", timelines, self.step))
            if self.png:
                title = f"Step {self.step}: {DEFAULT_TITLE}"
                self.written.append(plot_timelines(timelines, folder / f"step{self.step}.png", title=title))
            rank_zero_info(self._written_message())
        else:
            self.written.append(Path())

    def _written_message(self) -> str:
        """What was written, and why the PNG was not when it was left out."""
        message = f"`OverlapTimeline(step={self.step})`: wrote {', '.join(str(p) for p in self.written)}"
        if self.png:
            return message + "."
        if self._png_requested is False:
            return message + " (the PNG was not asked for: `png=False`)."
        return message + f"; the PNG is skipped because matplotlib is not installed. {PLOT_HINT}"

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.written and trainer.is_global_zero:
            warnings.warn(
                f"`OverlapTimeline(step={self.step})`: training ended at global_step={trainer.global_step} without "
                "reaching the step, or the strategy has no comm runtime (use `MoEOverlapStrategy`); nothing was "
                "written. Pick a smaller step.",
                RuntimeWarning,
                stacklevel=1,
            )
