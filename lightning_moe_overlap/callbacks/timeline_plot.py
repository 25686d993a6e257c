"""Draw step timelines (``timeline.py``) as a PNG with matplotlib, an optional extra (``pip install
"lightning-moe-overlap[plot]"``).

One band per rank, two rows per band: the forward context and the backward context. A row shows a bar per
:class:`~lightning_moe_overlap.overlap.timeline.RunSpan` (coloured by micro-batch, labelled ``F1`` / ``B0``), a
thin bar under it from each collective's issue to the end of its wait (in flight), and the wait itself in red
(exposed). In an overlapped step the F and B rows alternate at the comm points: one context's collective is in
flight under the other's compute.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_moe_overlap.overlap.timeline import StepTimeline

PLOT_HINT = 'Install it: pip install "lightning-moe-overlap[plot]" (or pip install matplotlib).'
DEFAULT_TITLE = "compute per context (colour = micro-batch), all-to-all in flight (grey), exposed (red)"


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError(f"`plot_timelines` needs matplotlib, which is not installed. {PLOT_HINT}") from err
    return plt


def plot_timelines(
    timelines: Sequence[StepTimeline], path: str | Path, *, title: str | None = None, dpi: int = 120
) -> Path:
    """Write the timelines of one step (one per rank) as a PNG at ``path``; returns the path.

    Raises:
        ImportError: matplotlib is not installed (the message has the install command).
        ValueError: ``timelines`` is empty.
    """
    if not timelines:
        raise ValueError("`plot_timelines`: got no timelines; pass at least one rank's `StepTimeline`.")
    plt = _pyplot()
    rows = [(t.rank, role) for t in timelines for role in ("forward", "backward")]
    fig, ax = plt.subplots(figsize=(12, 0.9 * len(rows) + 1.2))
    cmap = plt.get_cmap("tab10")
    y_of = {row: len(rows) - 1 - i for i, row in enumerate(rows)}
    for timeline in timelines:
        for run in timeline.runs:
            y = y_of[(timeline.rank, run.role)]
            color = cmap(int(run.task[1:]) % 10)
            ax.broken_barh([(run.start * 1e3, (run.end - run.start) * 1e3)], (y - 0.05, 0.45), color=color)
            if run.end - run.start > 0:
                ax.text((run.start + run.end) * 500, y + 0.17, run.task, ha="center", va="center", fontsize=6)
        for comm in timeline.comms:
            y = y_of[(timeline.rank, comm.role)]
            ax.broken_barh([(comm.issued * 1e3, comm.in_flight * 1e3)], (y - 0.3, 0.12), color="0.55")
            ax.broken_barh([(comm.wait_start * 1e3, comm.exposed * 1e3)], (y - 0.3, 0.12), color="tab:red")
    ax.set_yticks([y_of[row] for row in rows])
    ax.set_yticklabels([f"rank {rank} {role[0].upper()}" for rank, role in rows])
    ax.set_xlabel("ms since the step's first task")
    ax.set_title(title or f"One step: {DEFAULT_TITLE}")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
