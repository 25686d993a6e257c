"""SIGTERM while a checkpoint is being written (a 2-process run, the process group's timeout 10 minutes): every
process ends soon after, at the next batch boundary, with the save finished; the checkpoint it left is the one an
unbroken run writes at that step, and a resume from ``ckpt_path="last"`` starts there, never from a partial entry.

Oracles: the processes themselves (gone), the files on disk (no ``.partial-`` entry, ``last.ckpt`` committed), an
unbroken run of the same script (its step-2 checkpoint, bitwise the interrupted run's ``last.ckpt``), and the resumed
run's own record of the step it started from (that a resume mid-epoch then sees the batches the unbroken run saw is
Lightning's loop state: docs/checkpoints.md says what is exact).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_moe_overlap.checkpoint.atomic import read_marker
from lightning_moe_overlap.checkpoint.consolidated import load_consolidated_state_dict

pytestmark = pytest.mark.long  # three 2-process runs (about a minute): `python -m pytest -m long`
REPO = Path(__file__).resolve().parents[2]
HANG = 120  # seconds: far below the 10-minute timeout a hang waits out, far above a loaded machine's exit


def _start(root: Path, mode: str, slow: bool = False, background: bool = False) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "SLOW_SAVE": "1" if slow else "0",
           "ASYNC_SAVE": "1" if background else "0"}  # fmt: skip
    log = open(root / f"{mode}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen([sys.executable, "-m", "tests.helpers.sigterm_run", str(root), mode], cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip


def _wait(proc: subprocess.Popen, root: Path, mode: str) -> int:
    try:
        return proc.wait(timeout=HANG)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"{mode} still running {HANG} s on: {(root / f'{mode}.log').read_text()[-3000:]}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module", params=["sync", "async"])
def stopped(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run stopped by SIGTERM while its save of step 2 is written: synchronously, or in the background
    (``async_save=True``: then the signal lands while the steps go on and the save's thread writes)."""
    root = tmp_path_factory.mktemp(f"stopped-{request.param}")
    proc = _start(root, "run", slow=True, background=request.param == "async")
    deadline = time.monotonic() + HANG
    while not (root / "saving-0-3").exists():  # the first save of step 2 (each step saves its own and last.ckpt)
        assert proc.poll() is None and time.monotonic() < deadline, (root / "run.log").read_text()[-3000:]
        time.sleep(0.05)
    time.sleep(0.3)  # rank 0 is in the save's collectives, rank 1 sleeps in it
    os.kill(proc.pid, signal.SIGTERM)
    assert _wait(proc, root, "run") == 143, (root / "run.log").read_text()[-3000:]  # preempted, not finished
    time.sleep(1)
    pids = [int(p.read_text()) for p in root.glob("saving-*")]
    assert not [pid for pid in set(pids) if _alive(pid)], pids
    return root


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("unbroken")
    assert _wait(_start(root, "run"), root, "run") == 0, (root / "run.log").read_text()[-3000:]
    return root


def test_the_save_in_flight_completes_and_every_process_ends(stopped) -> None:
    names = sorted(p.name for p in (stopped / "ckpt").iterdir())
    assert not [n for n in names if ".partial-" in n], names
    assert "last.ckpt" in names and read_marker(stopped / "ckpt" / "last.ckpt")
    assert not (stopped / "run.json").exists()  # it stopped before its last step
    assert "received signal 15" in (stopped / "run.log").read_text()


def test_the_last_checkpoint_is_the_unbroken_runs_at_its_step(stopped, unbroken) -> None:
    last = load_consolidated_state_dict(stopped / "ckpt" / "last.ckpt")
    step = max(int(p.name.split("step=")[1].split(".")[0]) for p in (stopped / "ckpt").glob("epoch=*"))
    assert step == 2
    same_step = load_consolidated_state_dict(unbroken / "ckpt" / f"epoch=0-step={step}.ckpt")
    assert last.keys() == same_step.keys()
    assert [k for k in last if not torch.equal(last[k], same_step[k])] == []


def test_a_resume_starts_from_the_last_complete_checkpoint_never_a_partial_one(stopped) -> None:
    decoy = stopped / "ckpt" / "last.ckpt.partial-decoy0"  # what a save killed with SIGKILL leaves
    decoy.mkdir()
    (decoy / "__0_0.distcp").write_bytes(b"unfinished")
    assert _wait(_start(stopped, "resume"), stopped, "resume") == 0, (stopped / "resume.log").read_text()[-3000:]
    resumed = json.loads((stopped / "resume.json").read_text())
    assert resumed["start"] == 2 and len(resumed["losses"]) == 1  # from last.ckpt's step 2, one step to step 3
    log = (stopped / "resume.log").read_text()
    assert "ignored 1 partial checkpoint(s)" in log and "last.ckpt.partial-decoy0" in log
    assert "removed 1 partial checkpoint(s)" in log and not decoy.exists()
