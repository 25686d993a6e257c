"""`check` builds the trainer's loggers and callbacks as `fit` will; a missing optional package is a finding that
names the extra, and `fit` refuses it with the same one line (no traceback).

The missing package is simulated: ``sys.modules[name] = None`` makes ``import name`` fail, installed or not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lightning_moe_overlap.cli import check_main, main

ROOT = Path(__file__).resolve().parents[2]
CPU = str(ROOT / "examples" / "configs" / "cpu.yaml")
EXTRA = '`pip install -e ".[loggers]"` in a source checkout, or `pip install "lightning-moe-overlap[loggers]"`'


@pytest.fixture
def no_tensorboard(monkeypatch):
    for name in ("tensorboard", "tensorboardX"):
        monkeypatch.setitem(sys.modules, name, None)


@pytest.fixture
def tensorboard_yaml(tmp_path) -> str:
    path = tmp_path / "tb.yaml"
    path.write_text(
        "trainer:\n  logger:\n    class_path: lightning.pytorch.loggers.TensorBoardLogger\n"
        f"    init_args:\n      save_dir: {tmp_path / 'logs'}\n"
    )
    return str(path)


def test_check_reports_a_logger_whose_package_is_missing_with_the_extra(capsys, no_tensorboard, tensorboard_yaml):
    code = check_main(["--config", CPU, "--config", tensorboard_yaml])
    out = capsys.readouterr().out
    assert code == 1 and out.strip().endswith("1 error(s), 0 warning(s)"), out
    assert "[component-extra] ImportError: `trainer.logger` is `lightning.pytorch.loggers.TensorBoardLogger`, " \
           "which needs the `tensorboard` package (or `tensorboardX`), not installed here" in out
    assert EXTRA in out and "CSVLogger" in out


def test_fit_refuses_it_in_one_line_before_building_anything(capsys, no_tensorboard, tensorboard_yaml, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", CPU, "--config", tensorboard_yaml, "--trainer.devices=1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1
    assert err.startswith("lightning-moe-overlap fit: error: `trainer.logger` is ") and EXTRA in err, err
    assert "Traceback" not in err and "Does not validate" not in err
    assert not (tmp_path / "logs").exists()


def test_logger_list_and_callbacks_are_checked_too(capsys, no_tensorboard, tmp_path):
    code = check_main([
        "--config", CPU, "--trainer.logger+=CSVLogger", f"--trainer.logger.save_dir={tmp_path}",
        "--trainer.logger+=TensorBoardLogger", f"--trainer.logger.save_dir={tmp_path}",
        "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.every_n_epochs=-5",
    ])
    out = capsys.readouterr().out
    assert code == 1 and out.strip().endswith("2 error(s), 0 warning(s)"), out
    assert "[component-extra] ImportError: `trainer.logger[1]` is `lightning.pytorch.loggers.TensorBoardLogger`" in out
    assert "[component-build] RuntimeError: `trainer.callbacks[0]` is `lightning.pytorch.callbacks.ModelCheckpoint`, " \
           "and building it as `fit` does failed: MisconfigurationException: Invalid value for every_n_epochs=-5" in out


def test_loggers_that_build_are_no_finding(capsys, tmp_path):
    code = check_main(["--config", CPU, "--trainer.logger=CSVLogger", f"--trainer.logger.save_dir={tmp_path}"])
    out = capsys.readouterr().out
    assert code == 0 and out.strip().endswith("0 error(s), 0 warning(s)"), out
