"""No rank outlives the job, and the surviving ranks say which rank ended the run and why.

Each test runs ``tests/data/rank_exits_job.py`` as a user would run a script (Lightning's script launcher re-runs
it per rank) and checks, by pid, that no rank survives the job.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

JOB = Path(__file__).resolve().parents[1] / "data" / "rank_exits_job.py"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Requires: Linux (PR_SET_PDEATHSIG)")


def _start(mode: str, bad_rank: int, tmp_path: Path, devices: int, timeout_s: float) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(JOB), mode, str(bad_rank), str(tmp_path), str(devices), str(timeout_s)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
    )


def _alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _pids(tmp_path: Path, devices: int, wait_s: float = 120.0) -> dict[int, int]:
    deadline = time.monotonic() + wait_s
    files = [tmp_path / f"rank{r}.pid" for r in range(devices)]
    while not all(f.exists() and f.read_text() for f in files):
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.2)
    return {r: int(f.read_text()) for r, f in enumerate(files)}


def _wait_gone(pids: dict[int, int], wait_s: float) -> list[int]:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids.values()):
        time.sleep(0.1)
    return [r for r, p in pids.items() if _alive(p)]


def _finish(job: subprocess.Popen, limit_s: float) -> tuple[int, str, float]:
    start = time.monotonic()
    try:
        out, _ = job.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        job.kill()
        out, _ = job.communicate()
        pytest.fail(f"the job did not end within {limit_s} s:\n{out[-3000:]}")
    return job.returncode, out, time.monotonic() - start


@pytest.mark.long
def test_a_hung_rank_ignoring_sigterm_ends_with_the_job(tmp_path):
    job = _start("hang", 1, tmp_path, devices=2, timeout_s=8)
    pids = _pids(tmp_path, 2)
    code, out, waited = _finish(job, limit_s=90)
    assert code != 0
    # the collective times out (8 s), the peer report wait (1 s), the grace (8 s), SIGTERM ignored (3 s), SIGKILL
    assert waited < 60, out[-3000:]
    assert _wait_gone(pids, wait_s=5) == [], f"ranks outlived the job:\n{out[-3000:]}"
    assert "[rank 0] ended rank 1 (SIGKILL)" in out, out[-3000:]


@pytest.mark.long
def test_ranks_die_with_a_launching_process_killed_by_sigkill(tmp_path):
    job = _start("wait", -1, tmp_path, devices=2, timeout_s=120)
    pids = _pids(tmp_path, 2)
    time.sleep(1.0)  # every rank is inside training_step
    os.kill(job.pid, signal.SIGKILL)  # no exception, no atexit: only the parent-death signal ends rank 1
    job.communicate(timeout=30)
    assert _wait_gone(pids, wait_s=10) == []


def test_a_rank_killed_by_sigkill_is_named_by_every_survivor_in_one_line(tmp_path):
    job = _start("sigkill", 2, tmp_path, devices=3, timeout_s=120)
    pids = _pids(tmp_path, 3)
    code, out, _ = _finish(job, limit_s=120)
    assert code != 0
    assert "[rank 1] stopped because rank 2 was killed by SIGKILL." in out, out[-3000:]
    assert "PeerFailure: [rank 0] stopped because rank 2 was killed by SIGKILL." in out, out[-3000:]
    assert "[rank1]: Traceback" not in out  # the surviving child says it in one line
    assert len(out.splitlines()) < 60, out
    assert _wait_gone(pids, wait_s=5) == []


@pytest.mark.long  # the same attribution as the failure inside the step, outside it
def test_a_failure_outside_the_schedule_is_attributed_to_its_rank(tmp_path):
    job = _start("raise", 1, tmp_path, devices=2, timeout_s=120)
    pids = _pids(tmp_path, 2)
    code, out, _ = _finish(job, limit_s=120)
    assert code != 0
    assert "ValueError: boom outside the schedule" in out  # the failing rank's own traceback
    assert "[rank 0] stopped because rank 1 failed: ValueError: boom outside the schedule." in out, out[-3000:]
    assert _wait_gone(pids, wait_s=5) == []


def test_a_failure_inside_the_step_is_attributed_and_the_teardown_leaves_fsdp_alone(tmp_path):
    """Rank 1 raises in ``training_step``: rank 0 stops mid-step (its parameters gathered by FSDP) and its teardown
    must not touch that state (moving the module to the CPU crashed inside FSDP before)."""
    job = _start("raise-in-step", 1, tmp_path, devices=2, timeout_s=120)
    pids = _pids(tmp_path, 2)
    code, out, _ = _finish(job, limit_s=120)
    assert code != 0
    assert "ValueError: boom inside the step" in out
    assert "stopped on rank 0 because another rank failed first: rank 1: ValueError: boom inside the step." in out
    assert "_local_tensor" not in out and "During handling of the above exception" not in out, out[-4000:]
    assert _wait_gone(pids, wait_s=5) == []


@pytest.mark.long  # the path of an error of its own on every rank, one message
def test_the_same_error_on_every_rank_inside_the_step_is_shown_once(tmp_path):
    """Every rank raises the same ``ValueError`` in ``training_step``: rank 0's traceback, one line from rank 1 (not
    a second traceback, nor a ``PeerFailure`` chained to rank 0's own error)."""
    job = _start("raise-in-step", -1, tmp_path, devices=2, timeout_s=120)
    code, out, _ = _finish(job, limit_s=120)
    assert code != 0
    assert out.count("Traceback") == 1 and "PeerFailure:" not in out, out[-3000:]
    assert "[rank 1] stopped by the same error as rank 0 (rank 0 shows it): ValueError: boom inside the step" in out


def test_an_error_of_its_own_on_every_rank_is_shown_once_per_rank(tmp_path):
    """Every rank raises an error of its own in ``training_step`` (the messages differ): each is shown once, rank
    0's in full, rank 1's in full or, when rank 0 posted first, in rank 1's one line after the peer's; none behind a
    ``PeerFailure``."""
    job = _start("raise-in-step", -2, tmp_path, devices=2, timeout_s=120)
    code, out, _ = _finish(job, limit_s=120)
    assert code != 0
    assert "PeerFailure:" not in out, out[-3000:]
    shown = [int(r) for r in re.findall(r"^\[rank\d\]: ValueError: boom inside the step on rank (\d)$", out, re.M)]
    one_line = "This rank's own error: ValueError: boom inside the step on rank 1" in out
    assert sorted(shown + ([1] if one_line else [])) == [0, 1], out[-3000:]  # each rank's error once
    assert out.count("Traceback") == len(shown), out[-3000:]


@pytest.mark.long  # the same path as test_the_same_error_on_every_rank_inside_the_step_is_shown_once, marked
def test_an_error_every_rank_finds_after_spawning_is_shown_once(tmp_path):
    job = _start("late-config", -1, tmp_path, devices=2, timeout_s=120)
    code, out, _ = _finish(job, limit_s=120)
    assert code != 0
    assert out.count("num_experts=3, which ep=2 does not divide") == 1, out[-3000:]  # rank 0's error only
    assert out.count("Traceback") == 1, out[-3000:]
    assert "[rank 1] stopped by the configuration error every rank found (rank 0 shows it)." in out
