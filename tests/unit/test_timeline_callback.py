"""``OverlapTimeline`` says what it wrote and, when the PNG is left out, why: read from the files on disk."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_moe_overlap import OverlapTimeline
from lightning_moe_overlap.callbacks import timeline_callback as timeline_module
from lightning_moe_overlap.overlap.runtime import CommRuntime


def _trace_one_step(callback: OverlapTimeline, root: Path, monkeypatch) -> list[str]:  # noqa: ANN001
    said: list[str] = []
    monkeypatch.setattr(timeline_module, "rank_zero_info", said.append)
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(runtime=CommRuntime()), global_step=callback.step, global_rank=0,
        is_global_zero=True, default_root_dir=str(root),
    )
    callback.on_train_batch_start(trainer, None, None, 0)  # type: ignore[arg-type]
    callback.on_train_batch_end(trainer, None, None, None, 0)  # type: ignore[arg-type]
    return said


def _hide_matplotlib(monkeypatch) -> None:  # noqa: ANN001
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))


def test_without_matplotlib_the_skipped_png_and_the_trace_path_are_said(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    _hide_matplotlib(monkeypatch)
    said = _trace_one_step(OverlapTimeline(step=1), tmp_path, monkeypatch)
    trace = tmp_path / "timeline" / "step1.trace.json"
    assert json.loads(trace.read_text())["traceEvents"] is not None
    assert not (tmp_path / "timeline" / "step1.png").exists()
    assert len(said) == 1
    assert str(trace) in said[0]
    assert "PNG is skipped because matplotlib is not installed" in said[0] and "[plot]" in said[0]


def test_png_false_says_it_was_not_asked_for(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    said = _trace_one_step(OverlapTimeline(step=0, png=False, dirpath=str(tmp_path / "t")), tmp_path, monkeypatch)
    assert said == [f"`OverlapTimeline(step=0)`: wrote {tmp_path / 't' / 'step0.trace.json'} (the PNG was not asked "
                    "for: `png=False`)."]


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="Requires: matplotlib")
def test_with_matplotlib_both_files_are_named(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    said = _trace_one_step(OverlapTimeline(step=0), tmp_path, monkeypatch)
    png = tmp_path / "timeline" / "step0.png"
    assert png.exists() and str(png) in said[0]
