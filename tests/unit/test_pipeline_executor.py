"""The pipeline executor's and stage builder's errors (the runs themselves: tests/distributed/test_pipeline_overlap.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import ScheduleInterleaved1F1B

from lightning_moe_overlap._compat import torch as torch_compat
from lightning_moe_overlap.overlap import CommRuntime, OverlapEngine
from lightning_moe_overlap.pipeline.executor import PipelineExecutor
from lightning_moe_overlap.pipeline.schedules import build_stages


def test_overlap_needs_a_multi_stage_schedule() -> None:
    single = SimpleNamespace(step=lambda *a, **k: None)  # like Schedule1F1B: no custom actions
    with pytest.raises(TypeError, match=r"one stage per rank and has no OVERLAP_F_B.*`interleaved_1f1b`"):
        PipelineExecutor(single, OverlapEngine(CommRuntime(), overlap=True))
    assert PipelineExecutor(single, OverlapEngine(CommRuntime(), overlap=False)).overlap is False


def test_a_pair_outside_executor_step_is_refused() -> None:
    stages = [SimpleNamespace(num_stages=4, group_size=2, group_rank=0, stage_index=s) for s in (0, 2)]
    schedule = ScheduleInterleaved1F1B(stages, 4, loss_fn=lambda out, target: out)
    executor = PipelineExecutor(schedule, OverlapEngine(CommRuntime(), overlap=True))
    pair = torch_compat.pipeline_action(
        -1, "OVERLAP_F_B", None, (torch_compat.pipeline_action(0, "F", 2), torch_compat.pipeline_action(2, "B", 0))
    )
    with pytest.raises(RuntimeError, match=r"outside `PipelineExecutor.step`; call `executor.step"):
        executor._overlap_f_b(pair, None)


def test_build_stages_needs_one_chunk_per_stage() -> None:
    with pytest.raises(ValueError, match=r"1 chunks for stages \[0, 2\]\. Pass one chunk per stage"):
        build_stages([nn.Linear(2, 2)], [0, 2], 4, None, torch.device("cpu"))  # type: ignore[arg-type]
