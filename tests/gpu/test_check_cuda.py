"""`check` with machine checks on a CUDA machine: the GPU configs find a CUDA device (the CPU twin is
tests/cli/test_check.py::test_gpu_config_on_a_machine_without_cuda)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_moe_overlap.cli import check_main

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="Requires: CUDA (a GPU machine)")


def test_gpu_config_passes_machine_checks_on_a_cuda_machine(capsys):
    code = check_main(["--config", str(CONFIGS / "gpu.yaml")])
    out = capsys.readouterr().out
    assert "[cuda-unavailable]" not in out
    assert code == 0, out
