"""A configuration error found at the first step, alike on every rank, is shown once: rank 0's traceback in full,
one line from each other rank, and the job ends with a non-zero status instead of hanging.

The job (``tests/data/first_step_error_job.py``) runs as a user runs a script, ``python -m`` with ``devices=2`` on
CPU (Lightning's script launcher re-runs it for rank 1); the combined output is what the user reads.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MESSAGE = "`num_microbatches=3` but the batch holds no tensor with a batch dimension to split"
POINTER = "[rank 1] stopped by the configuration error every rank found (rank 0 shows it)."
HANG_S = 240  # far above the job's own run (a few seconds): reaching it means a rank hung


@pytest.fixture(scope="module")
def job() -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            [sys.executable, "-m", "tests.data.first_step_error_job"], cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=HANG_S,
        )
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"the job did not end within {HANG_S} s (a rank hung):\n{expired.output}")


def test_the_error_is_shown_once_in_full(job) -> None:  # noqa: ANN001
    out = job.stdout
    assert out.count("Traceback (most recent call last)") == 1, out[-4000:]
    assert out.count(MESSAGE) == 1, out[-4000:]
    assert out.rstrip().splitlines()[-1].endswith(f"ValueError: `MoEOverlapStrategy`: {MESSAGE}. Return tensors "
                                                  "from the dataloader, or set `num_microbatches=1`.")


def test_the_other_rank_ends_with_one_line(job) -> None:  # noqa: ANN001
    assert job.stdout.count(POINTER) == 1, job.stdout[-4000:]


def test_the_job_fails(job) -> None:  # noqa: ANN001
    assert job.returncode != 0
