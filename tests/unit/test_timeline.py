"""The step timeline: records of an overlapped step, its Chrome trace, and the PNG (when matplotlib is there)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch
from torch import nn

from lightning_moe_overlap.overlap import CommRuntime, run_schedule
from lightning_moe_overlap.overlap.timeline import (
    StepTimeline,
    TimelineRecorder,
    chrome_trace,
    timelines_from_trace,
    write_chrome_trace,
)
from lightning_moe_overlap.callbacks.timeline_plot import plot_timelines


class DoneWork:
    def wait(self) -> bool:
        return True


class CommPoint(torch.autograd.Function):
    """Identity with a full comm point (issue, hand-over, wait) in forward and in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, runtime: CommRuntime) -> torch.Tensor:  # noqa: ANN001
        ctx.runtime = runtime
        runtime.handoff()
        runtime.wait(DoneWork())
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        ctx.runtime.handoff()
        ctx.runtime.wait(DoneWork())
        return grad.clone(), None


def traced_step(overlap: bool, layers: int = 3, m: int = 3) -> tuple[StepTimeline, list[torch.Tensor]]:
    torch.manual_seed(0)
    net = nn.ModuleList(nn.Linear(8, 8) for _ in range(layers))
    x = torch.randn(m, 4, 8)
    runtime = CommRuntime()
    runtime.attach(recorder := TimelineRecorder(rank=0))

    def forward(i: int) -> torch.Tensor:
        h = x[i]
        for layer in net:
            h = CommPoint.apply(torch.tanh(layer(h)), runtime)
        return h.square().mean()

    run_schedule(forward, lambda i, loss: loss.backward(), m, runtime, overlap=overlap)
    return recorder.timeline(), [p.grad.clone() for p in net.parameters()]


def switches(timeline: StepTimeline, pair: set[str]) -> list[str]:
    """The task names of the pair's run spans in time order."""
    return [r.task for r in sorted(timeline.runs, key=lambda r: r.start) if r.task in pair]


def test_overlapped_step_interleaves_forward_and_backward_at_comm_points() -> None:
    timeline, _ = traced_step(overlap=True)
    trace = json.loads(json.dumps(chrome_trace([timeline], step=0)))
    parsed = timelines_from_trace(trace)[0]
    order = switches(parsed, {"F1", "B0"})
    # B0 starts the pair; each comm point hands over: B0 F1 B0 F1 ... with at least three alternations.
    assert order[0] == "B0"
    assert sum(a != b for a, b in zip(order, order[1:])) >= 3
    # Every run span of the pair that ends with a hand-over ends right after one of its own comm issues.
    issues = {(c.task, round(c.issued * 1e6)) for c in parsed.comms}
    runs = sorted((r for r in parsed.runs if r.task in {"F1", "B0"}), key=lambda r: r.start)
    last = {r.task: r for r in runs}  # a task's last span ends with the task, not with a hand-over
    for run, nxt in zip(runs, runs[1:]):
        if run.task != nxt.task and run is not last[run.task]:
            own = [c for c in parsed.comms if c.task == run.task and run.start - 1e-6 <= c.issued <= run.end + 1e-6]
            assert own, f"{run.task} handed over at {run.end} without issuing a collective"
    assert issues
    # Exposure never exceeds the time in flight, and each comm point is waited on once.
    for c in parsed.comms:
        assert 0 <= c.exposed <= c.in_flight + 1e-9
    names = [(c.task, c.index) for c in parsed.comms]
    assert len(names) == len(set(names))


def test_sequential_step_never_interleaves() -> None:
    timeline, _ = traced_step(overlap=False)
    order = [r.task for r in sorted(timeline.runs, key=lambda r: r.start)]
    collapsed = [t for i, t in enumerate(order) if i == 0 or order[i - 1] != t]
    assert collapsed == ["F0", "B0", "F1", "B1", "F2", "B2"]


def test_tracing_changes_no_result() -> None:
    _, traced = traced_step(overlap=True)
    torch.manual_seed(0)
    net = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
    x = torch.randn(3, 4, 8)
    runtime = CommRuntime()

    def forward(i: int) -> torch.Tensor:
        h = x[i]
        for layer in net:
            h = CommPoint.apply(torch.tanh(layer(h)), runtime)
        return h.square().mean()

    run_schedule(forward, lambda i, loss: loss.backward(), 3, runtime, overlap=True)
    for a, b in zip(traced, (p.grad for p in net.parameters())):
        assert torch.equal(a, b)


def test_chrome_trace_format(tmp_path) -> None:  # noqa: ANN001
    timeline, _ = traced_step(overlap=True, layers=1, m=2)
    path = write_chrome_trace(tmp_path / "sub" / "trace.json", [timeline, StepTimeline(rank=1)], step=7)
    trace = json.loads(path.read_text())
    assert trace["otherData"]["step"] == 7
    events = trace["traceEvents"]
    assert {e["ph"] for e in events} == {"M", "X", "i"}
    assert {e["pid"] for e in events} == {0, 1}
    for e in events:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0 and e["cat"] in ("compute", "comm", "exposed")
    assert {e["name"] for e in events if e.get("cat") == "compute"} == {"F0", "F1", "B0", "B1"}


def test_comm_outside_a_schedule_is_not_recorded() -> None:
    runtime = CommRuntime()
    runtime.attach(recorder := TimelineRecorder())
    runtime.handoff()
    runtime.wait(DoneWork())
    assert recorder.timeline().comms == [] and recorder.timeline().runs == []


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="Requires: matplotlib (the plot extra)")
def test_png_is_written(tmp_path) -> None:  # noqa: ANN001
    timeline, _ = traced_step(overlap=True)
    path = plot_timelines([timeline], tmp_path / "step.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_without_matplotlib_names_the_extra(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"needs matplotlib.*lightning-moe-overlap\[plot\]"):
        plot_timelines([StepTimeline()], tmp_path / "x.png")


def test_png_needs_a_timeline(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="got no timelines"):
        plot_timelines([], tmp_path / "x.png")
