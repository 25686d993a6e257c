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


def test_pipeline_options_parse_and_default_to_all_of_dp_for_ep() -> None:
    cfg, _ = bench.parse_args(["--ranks", "4", "--pp", "2", "--vpp", "2", "--layers", "8"])
    assert (cfg.pp, cfg.vpp, cfg.ep_size, cfg.schedule_name) == (2, 2, 2, "interleaved_1f1b")
    assert bench.modes_of(cfg) == ["sequential", "overlap"]
    cfg, _ = bench.parse_args(["--ranks", "2", "--pp", "2"])
    assert (cfg.ep_size, cfg.schedule_name, bench.modes_of(cfg)) == (1, "1f1b", ["sequential"])


PP2 = ["--ranks", "4", "--pp", "2", "--vpp", "2"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--vpp", "2"], r"--vpp 2 / --pipeline-schedule None need --pp >= 2, got --pp 1"),
        (["--pp", "0"], r"--pp 0 / --vpp 1: both must be >= 1"),
        ([*PP2, "--monitor"], r"measures overlap off and on only; drop --monitor"),
        ([*PP2, "--device", "cuda"], r"CPU \(gloo\) only so far; use --device cpu"),
        ([*PP2, "--layers", "6"], r"--layers 6 must split evenly into pp \* vpp = 4"),
        (["--ranks", "3", "--pp", "2"], r"world_size=3 .* not a multiple of pp\*cp\*tp=2"),
        (["--ranks", "4", "--pp", "2", "--ep", "4"], r"ep=4 does not divide dp\*cp=2"),
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


def test_action_clock_counts_overlapping_actions_of_two_threads_once() -> None:
    clock = pipelined.ActionClock()

    class Stage:
        def forward_one_chunk(self, s: float) -> float:
            time.sleep(s)
            return s

        backward_one_chunk = backward_weight_one_chunk = forward_one_chunk

    stage = Stage()
    clock.attach(stage)
    start = time.perf_counter()
    threads = [threading.Thread(target=stage.forward_one_chunk, args=(0.05,)),
               threading.Thread(target=stage.backward_one_chunk, args=(0.05,))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(0.05)  # idle: no action
    assert stage.backward_weight_one_chunk(0.02) == 0.02
    wall = time.perf_counter() - start
    actions, spans = clock.reset()
    assert actions == 3 and len(spans) == 2  # the two concurrent actions merge into one span
    busy = pipelined.length(spans)
    assert 0.07 <= busy < wall - 0.04, (busy, wall)  # the two concurrent 50 ms count once, the 50 ms gap not at all
    assert clock.reset() == (0, [])


def test_concurrency_is_one_when_ranks_take_turns_and_pp_when_they_compute_together() -> None:
    turns = [[(0.0, 1.0), (2.0, 3.0)], [(1.0, 2.0), (3.0, 4.0)]]
    together = [[(0.0, 2.0)], [(0.0, 2.0)], [(0.0, 1.5), (1.5, 2.0)]]
    assert pipelined.concurrency(turns) == 1.0
    assert pipelined.concurrency(together) == 3.0
    assert pipelined.concurrency([[(0.0, 2.0)], [(1.0, 3.0)]]) == pytest.approx(4.0 / 3.0)
    assert pipelined.concurrency([[], []]) == 0.0
