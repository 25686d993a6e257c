"""Every test runs in its own temporary directory, so nothing (``lightning_logs/``, ``config.yaml``, checkpoints)
lands in the repository; tests that need the repository name it by absolute path."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _run_in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
