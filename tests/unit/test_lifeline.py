"""The pieces that end every rank with the job and say why a rank ended."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from lightning_moe_overlap.processes.exits import ExitBoard
from lightning_moe_overlap.processes.lifeline import ChildReaper, describe_exit

IGNORES_SIGTERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"


def test_describe_exit_names_the_signal_or_the_code():
    assert describe_exit(-9) == "was killed by SIGKILL"
    assert describe_exit(-15) == "was killed by SIGTERM"
    assert describe_exit(3) == "exited with code 3"


@pytest.mark.skipif(sys.platform == "win32", reason="Requires: POSIX signals")
def test_reaper_ends_a_child_that_ignores_sigterm_and_reports_it_once():
    child = subprocess.Popen([sys.executable, "-c", IGNORES_SIGTERM], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    reported: list[tuple[int, int]] = []
    reaper = ChildReaper([child], lambda r, code: reported.append((r, code)), term_grace_s=0.5).start()
    sent = reaper.reap(grace_s=0.2)
    assert sent == {1: "SIGKILL"} and child.returncode == -signal.SIGKILL
    assert reaper.reap(grace_s=0.2) == {}  # idempotent
    time.sleep(0.3)
    assert reported == [(1, -signal.SIGKILL)]


def test_reaper_leaves_children_that_end_in_time_alone():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    reaper = ChildReaper([child], lambda r, code: pytest.fail("not abnormal"))
    assert reaper.reap(grace_s=30) == {} and child.returncode == 0


def test_exit_board_names_the_first_other_rank():
    store = dist.HashStore()
    me, other = ExitBoard(store, rank=0), ExitBoard(store, rank=2)
    assert me.first_peer() is None
    me.post_failure(ValueError("mine"))
    assert me.first_peer() is None  # its own report is not a peer's
    assert other.first_peer() == "rank 0 failed: ValueError: mine"
    other.post(1, "was killed by SIGKILL")
    assert other.first_peer() == "rank 0 failed: ValueError: mine"  # the first report wins
    assert ExitBoard(store, rank=0).first_peer(wait_s=0.1) == "rank 1 was killed by SIGKILL"
