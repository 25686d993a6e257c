"""``benchmarks/overlap.py --pp``: the options it refuses before launching anything, and the two bubble counts of
``benchmarks/pipelined.py`` (idle slots of an order, time inside compute actions) on hand-made inputs."""

from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import overlap as bench  # noqa: E402
import pipelined  # noqa: E402

from tests.helpers.clock import VirtualClock  # noqa: E402


def test_pipeline_options_parse_and_default_to_all_of_dp_for_ep() -> None:
    cfg, _ = bench.parse_args(["--ranks", "4", "--pp", "2", "--vpp", "2", "--layers", "8"])
    assert (cfg.pp, cfg.vpp, cfg.ep_size, cfg.schedule_name) == (2, 2, 2, "interleaved_1f1b")
    assert bench.modes_of(cfg) == ["sequential", "overlap"]
    cfg, _ = bench.parse_args(["--ranks", "2", "--pp", "2"])
    assert (cfg.ep_size, cfg.schedule_name, bench.modes_of(cfg)) == (1, "1f1b", ["sequential", "overlap"])


PP2 = ["--ranks", "4", "--pp", "2", "--vpp", "2"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--vpp", "2"], r"--vpp 2 / --pipeline-schedule None / --compare-schedules / --a2a-delay-ms need --pp >= 2"),
        ([*PP2, "--a2a-delay-ms", "-1"], r"--a2a-delay-ms -1: must be >= 0"),
        ([*PP2, "--compare-schedules", "--microbatches", "3"], r"multiple of pp, got 3"),
        (["--pp", "0"], r"--pp 0 / --vpp 1: both must be >= 1"),
        ([*PP2, "--monitor"], r"measures overlap off and on only; drop --monitor"),
        ([*PP2, "--device", "cuda"], r"CPU \(gloo\) only so far; use --device cpu"),
        ([*PP2, "--layers", "6"], r"--layers 6 must split evenly into pp \* vpp = 4"),
        (["--ranks", "3", "--pp", "2"], r"world_size=3 .* not a multiple of pp\*cp\*tp=2"),
        (["--ranks", "4", "--pp", "2", "--ep", "4"], r"ep=4 does not divide dp\*cp\*tp=2"),
        ([*PP2, "--microbatches", "5"], r"multiple of pp.*Use 4 or 6 micro-batches"),
        (
            ["--ranks", "4", "--pp", "2", "--vpp", "3", "--layers", "12", "--pipeline-schedule", "dualpipev"],
            r"dualpipev.*exactly two stages per rank.*Set vpp=2",
        ),
    ],
)
def test_pipeline_options_that_cannot_run_exit_with_the_reason(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_slot_bubble_counts_idle_slots_and_the_tail_after_a_shorter_rank() -> None:
    order = {0: ["F0", "F1", None, "B0", "B1"], 1: [None, "F0", "B0", "F1|B?"]}
    assert pipelined.slot_bubble(order) == {0: (1, 5), 1: (2, 5)}


def test_action_clock_counts_overlapping_actions_of_two_threads_once(monkeypatch) -> None:
    """Two actions of two threads overlap, a gap follows, then a third action: on a virtual clock the spans are exactly
    the union of the actions (the overlap counted once, the gap not at all)."""
    clock = VirtualClock().install(monkeypatch, pipelined)
    action_clock = pipelined.ActionClock()

    class Stage:
        def forward_one_chunk(self, body):
            return body()

        backward_one_chunk = backward_weight_one_chunk = forward_one_chunk

    stage = Stage()
    action_clock.attach(stage)
    started = {name: threading.Event() for name in ("F", "B")}
    finish = {name: threading.Event() for name in ("F", "B")}

    def action(name: str):
        def body() -> str:
            started[name].set()
            assert finish[name].wait(30)
            return name

        return body

    forward = threading.Thread(target=stage.forward_one_chunk, args=(action("F"),))
    backward = threading.Thread(target=stage.backward_one_chunk, args=(action("B"),))
    forward.start()  # F starts at 0
    assert started["F"].wait(30)
    clock.advance_to(1.0)
    backward.start()  # B starts at 1, while F runs
    assert started["B"].wait(30)
    clock.advance_to(3.0)
    finish["F"].set()  # F ends at 3
    forward.join(30)
    clock.advance_to(4.0)
    finish["B"].set()  # B ends at 4
    backward.join(30)
    clock.advance_to(6.0)  # idle: no action

    def weight() -> float:
        clock.advance(0.5)
        return 0.5

    assert stage.backward_weight_one_chunk(weight) == 0.5
    actions, spans = action_clock.reset()
    assert actions == 3
    assert spans == [(0.0, 4.0), (6.0, 6.5)]  # the two concurrent actions merge into one span; the gap is not busy
    assert pipelined.length(spans) == 4.5
    assert action_clock.reset() == (0, [])


def test_concurrency_is_one_when_ranks_take_turns_and_pp_when_they_compute_together() -> None:
    turns = [[(0.0, 1.0), (2.0, 3.0)], [(1.0, 2.0), (3.0, 4.0)]]
    together = [[(0.0, 2.0)], [(0.0, 2.0)], [(0.0, 1.5), (1.5, 2.0)]]
    assert pipelined.concurrency(turns) == 1.0
    assert pipelined.concurrency(together) == 3.0
    assert pipelined.concurrency([[(0.0, 2.0)], [(1.0, 3.0)]]) == pytest.approx(4.0 / 3.0)
    assert pipelined.concurrency([[], []]) == 0.0


def test_compare_schedules_runs_every_schedule_off_and_on_with_1f1b_sequential_first() -> None:
    cfg, _ = bench.parse_args(["--ranks", "4", "--pp", "2", "--layers", "8", "--compare-schedules"])
    runs = pipelined.pp_modes(cfg)
    assert list(runs)[0] == "1f1b/sequential" and len(runs) == 6
    assert {(schedule, vpp) for schedule, vpp, _ in runs.values()} == {
        ("1f1b", 1), ("interleaved_1f1b", 2), ("dualpipev", 2)
    }
    assert sorted(overlap for *_, overlap in runs.values()) == [False] * 3 + [True] * 3


def test_a_delayed_all_to_all_is_waited_no_earlier_than_its_delay(monkeypatch) -> None:
    class Done:
        def wait(self) -> str:
            return "done"

    monkeypatch.setattr(pipelined.TORCH, "all_to_all", lambda *args, **kwargs: Done())
    work = pipelined.DelayedCommunicator(0.05).all_to_all(None, None, [], [], None)
    assert work.wait() == "done" and time.perf_counter() >= work.until  # a lower bound: sleep returns no earlier
