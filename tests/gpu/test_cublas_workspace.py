"""``CUBLAS_WORKSPACE_CONFIG`` is in the environment of every GPU test: set when the suite is collected
(tests/gpu/conftest.py), since cuBLAS reads it at a process's first GEMM and a fixture of one test would come too
late for the tests that ran before it. No CUDA needed: the check is on the environment."""

from __future__ import annotations

import os


def test_workspace_config_is_set_for_the_whole_suite() -> None:
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") in (":4096:8", ":16:8")
