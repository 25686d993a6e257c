"""Pipeline schedules by name: validation, the OVERLAP_F_B rewrite of interleaved 1F1B, the rendered order.

Orders are computed from the schedules themselves with stand-in stages (the order needs only sizes, no group)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining import ScheduleDualPipeV, ScheduleInterleaved1F1B

from lightning_moe_overlap._compat import torch as torch_compat
from lightning_moe_overlap.pipeline.schedules import (
    count_pairs,
    default_schedule,
    overlap_pairs,
    render_order,
    stage_indices,
    validate_schedule,
)


def stages(pp: int, vpp: int, style: str = "loop") -> list[SimpleNamespace]:
    indices = stage_indices("dualpipev" if style == "v" else "interleaved_1f1b", pp=pp, vpp=vpp, pp_rank=0)
    return [SimpleNamespace(num_stages=pp * vpp, group_size=pp, group_rank=0, stage_index=i, submod=None) for i in indices]


def interleaved(pp: int, m: int) -> ScheduleInterleaved1F1B:
    return ScheduleInterleaved1F1B(stages(pp, 2), m, loss_fn=lambda out, target: out)


def tasks_of(order: dict) -> dict[int, list[str]]:
    """Each rank's compute actions in order, pairs unfolded forward first."""
    out = {}
    for rank, actions in order.items():
        out[rank] = [
            str(sub)
            for a in actions
            if a is not None
            for sub in (a.sub_actions if torch_compat.action_kind(a) == "OVERLAP_F_B" else (a,))
        ]
    return out


def test_defaults_and_stage_layouts() -> None:
    assert default_schedule(1) == "1f1b" and default_schedule(2) == "interleaved_1f1b"
    assert stage_indices("interleaved_1f1b", pp=2, vpp=2, pp_rank=1) == [1, 3]
    assert stage_indices("dualpipev", pp=2, vpp=2, pp_rank=0) == [0, 3]


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (2, 8), (4, 8)])
def test_rewrite_pairs_steady_state_keeps_every_ranks_compute_order_and_lowers(pp: int, m: int) -> None:
    schedule = interleaved(pp, m)
    plain = tasks_of(schedule.pipeline_order)
    order = overlap_pairs(schedule)
    assert all(n > 0 for n in count_pairs(order).values()), count_pairs(order)
    rewritten = tasks_of(order)
    for rank in plain:  # the same tasks; per stage the same order of backwards (gradient accumulation order)
        assert sorted(rewritten[rank]) == sorted(plain[rank])
        backwards = lambda tasks: [t for t in tasks if "B" in t]  # noqa: E731
        assert backwards(rewritten[rank]) == backwards(plain[rank])
    torch_compat.relower_pipeline_order(schedule, order)  # torch's lowering schedules every send and receive
    for actions in order.values():
        for a in actions:
            if a is not None and torch_compat.action_kind(a) == "OVERLAP_F_B":
                f, b = a.sub_actions
                assert (f.stage_index, f.microbatch_index) != (b.stage_index, b.microbatch_index)


def test_rewrite_is_deterministic_and_leaves_the_schedule_as_it_was() -> None:
    schedule = interleaved(2, 4)
    before = {r: list(a) for r, a in schedule.pipeline_order.items()}
    assert overlap_pairs(schedule) == overlap_pairs(interleaved(2, 4))
    assert schedule.pipeline_order == before


def test_render_shows_pairs_and_bubbles_from_the_schedule() -> None:
    text = render_order(overlap_pairs(interleaved(2, 4)))
    lines = text.splitlines()
    assert [line.split(":")[0] for line in lines] == ["rank 0", "rank 1"]
    assert lines[0].split()[2:8] == ["0F0", "0F1", "2F0", "2F1", ".", "."]
    assert "0F2|2B0" in lines[0] and "3F1|3B0" in lines[1]
    dualpipe = ScheduleDualPipeV(stages(2, 2, "v"), 4, loss_fn=lambda out, target: out)
    assert "0F3|3B1" in render_order(dualpipe.pipeline_order, ranks=[0]) and "3I0" in render_order(dualpipe.pipeline_order)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(name="gpipe", vpp=1, num_microbatches=4), ValueError, r"Unknown `pipeline_schedule='gpipe'`.*1f1b, interleaved_1f1b"),
        (dict(name="interleaved_1f1b", vpp=2, num_microbatches=5), ValueError, r"multiple of pp, got 5 .*pp=2\. Use 4 or 6"),
        (dict(name="interleaved_1f1b", vpp=1, num_microbatches=4), ValueError, r"interleaves virtual stages, got vpp=1"),
        (dict(name="1f1b", vpp=2, num_microbatches=4), ValueError, r"one stage per rank, got vpp=2"),
        (dict(name="dualpipev", vpp=3, num_microbatches=8), ValueError, r"exactly two stages per rank.*vpp=3\. Set vpp=2"),
        (dict(name="dualpipev", vpp=2, num_microbatches=3), ValueError, r"stages \(pp \* vpp = 4\), got 3\. Use num_microbatches >= 4"),
        (dict(name="zero_bubble", vpp=2, num_microbatches=4, overlap=True), NotImplementedError, r"zero_bubble.*input and weight"),
        (dict(name="1f1b", vpp=1, num_microbatches=0), ValueError, r"`num_microbatches=0`: must be an int >= 1"),
    ],
)
def test_validation_names_values_rule_and_fix(kwargs: dict, error: type, match: str) -> None:
    args = {"pp": 2, "overlap": False, **kwargs}
    with pytest.raises(error, match=match):
        validate_schedule(args.pop("name"), **args)


def test_valid_combinations_pass() -> None:
    validate_schedule("interleaved_1f1b", pp=2, vpp=2, num_microbatches=4, overlap=True)
    validate_schedule("dualpipev", pp=2, vpp=2, num_microbatches=4, overlap=True)
    validate_schedule("1f1b", pp=2, vpp=1, num_microbatches=3, overlap=False)
    validate_schedule("1f1b", pp=2, vpp=1, num_microbatches=2, overlap=True)  # the paired order (paired_1f1b.py)
    validate_schedule("1f1b", pp=1, vpp=1, num_microbatches=3, overlap=True)  # pp=1: the engine's own schedule


def test_docs_show_the_orders_the_schedules_compute() -> None:
    from pathlib import Path

    from lightning_moe_overlap.pipeline.schedules import docs_orders

    text = (Path(__file__).parents[2] / "docs" / "pipeline.md").read_text()
    block = text.split("<!-- orders:begin -->\n```text\n")[1].split("\n```\n<!-- orders:end -->")[0]
    assert block == docs_orders(), "docs/pipeline.md is stale: paste the output of `docs_orders()` into its block"
