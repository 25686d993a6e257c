"""The private torch names of ``_compat`` still exist and behave (a failure here names the torch version)."""

from __future__ import annotations

import pytest
import torch

from lightning_moe_overlap._compat import torch as torch_compat


def test_private_torch_names_exist() -> None:
    for name in ("_foreach_norm", "_foreach_mul_"):
        assert hasattr(torch, name), f"torch {torch.__version__} has no `torch.{name}`; update `_compat`"
    assert hasattr(torch.cuda, "_sleep"), f"torch {torch.__version__} has no `torch.cuda._sleep`; update `_compat`"


def test_foreach_helpers_match_the_plain_ops() -> None:
    tensors = [torch.arange(4.0), torch.full((2, 3), -2.0)]
    norms = torch_compat.foreach_norm(tensors, 2.0, dtype=torch.float64)
    assert [n.dtype for n in norms] == [torch.float64] * 2
    assert torch.equal(torch.stack(norms), torch.stack([t.double().norm() for t in tensors]))
    torch_compat.foreach_mul_(tensors, torch.tensor(0.5))
    assert torch.equal(tensors[0], torch.arange(4.0) / 2) and torch.equal(tensors[1], torch.full((2, 3), -1.0))


# -- torch.distributed.pipelining: the private runtime names used by pipeline/ --------------------------------------
def test_private_pipelining_names_exist() -> None:
    from torch.distributed.pipelining import schedules

    version = f"torch {torch.__version__}"
    for name in ("_Action", "_ComputationType", "_PipelineScheduleRuntime", "_PipelineContext", "_wait_batch_p2p"):
        assert hasattr(schedules, name), f"{version}: `pipelining.schedules.{name}` is gone; update `_compat/torch.py`"
    runtime = schedules._PipelineScheduleRuntime
    for name in ("register_custom_function", "_prepare_schedule_with_comms", "_maybe_compute_loss", "_maybe_get_loss"):
        assert hasattr(runtime, name), f"{version}: `_PipelineScheduleRuntime.{name}` is gone; update `_compat`"
    fields = set(schedules._PipelineContext.__dataclass_fields__)
    assert {"schedule_ref", "arg_mbs", "kwarg_mbs", "target_mbs"} <= fields, f"{version}: _PipelineContext {fields}"


def test_pipeline_actions_build_and_print_as_torch_parses_them() -> None:
    forward = torch_compat.pipeline_action(0, "F", 7)
    backward = torch_compat.pipeline_action(2, "B", 3)
    pair = torch_compat.pipeline_action(-1, "OVERLAP_F_B", None, (forward, backward))
    assert str(forward) == "0F7" and torch_compat.action_kind(backward) == "B"
    assert torch_compat.action_kind(pair) == "OVERLAP_F_B"
    parsed = torch_compat.pipeline_schedules()._Action.from_str(str(pair))
    assert parsed == pair, f"torch {torch.__version__}: OVERLAP_F_B round trip gave {parsed}"


def test_the_runtime_state_an_overlap_handler_uses() -> None:
    from types import SimpleNamespace

    from torch.distributed.pipelining import ScheduleInterleaved1F1B

    stages = [SimpleNamespace(num_stages=4, group_size=2, group_rank=0, stage_index=s) for s in (0, 2)]
    schedule = ScheduleInterleaved1F1B(stages, 4, loss_fn=lambda out, target: out)
    calls: list[str] = []
    torch_compat.register_pipeline_action(schedule, "OVERLAP_F_B", lambda action, ctx: calls.append(str(action)))
    assert len(torch_compat.lowered_pipeline_order(schedule)[0]) > len([a for a in schedule.pipeline_order[0] if a])
    assert [s.stage_index for s in torch_compat.pipeline_stages(schedule)] == [0, 2]
    assert torch_compat.pipeline_microbatches(schedule) == 4
    assert [torch_compat.count_pipeline_backward(schedule, 2) for _ in range(4)] == [False, False, False, True]
    with pytest.raises(RuntimeError, match=r"stage 2, micro-batch 1: its backward input was never received"):
        torch_compat.wait_pipeline_recv(schedule, "backward", 2, 1)
