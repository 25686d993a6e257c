"""`check` prints the memory table per pp rank and warns above `--memory-gb`; a bad `--memory-gb` names the rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_moe_overlap.cli import check_main

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"


def test_table_per_pp_rank_and_the_warning(capsys):
    code = check_main(["--config", str(CONFIGS / "cpu_pp.yaml"), "--memory-gb", "1e-6"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "Memory per process" in out and "  pp 0 " in out.replace("pp 0:", "") and "pp 1" in out
    assert out.count("[memory] warning: pp rank") == 2


def test_no_warning_under_the_limit(capsys):
    code = check_main(["--config", str(CONFIGS / "cpu.yaml"), "--memory-gb", "80"])
    out = capsys.readouterr().out
    assert code == 0 and "Memory per process" in out and "[memory]" not in out, out


def test_memory_gb_not_a_positive_number(capsys):
    with pytest.raises(SystemExit):
        check_main(["--config", str(CONFIGS / "cpu.yaml"), "--memory-gb", "-1"])
    err = capsys.readouterr().err
    assert "--memory-gb='-1' is not a positive number" in err and "Pass e.g. `--memory-gb 80`" in err
