"""``lightning-moe-overlap convert-checkpoint``: a source it cannot convert ends with the message, no traceback.

Each refusal exits with status 1 and prints ``lightning-moe-overlap convert-checkpoint: error: <message>`` on
stderr; bad arguments exit with argparse's usage (status 2). One case runs the console entry point in a
subprocess, the others call ``main`` in this process (an escaping exception would fail them).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_moe_overlap.checkpoint import convert_legacy_checkpoint
from lightning_moe_overlap.cli import main

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "legacy_v1" / "checkpoint"
PROG = "lightning-moe-overlap convert-checkpoint: error: "


def _plant(marker: str) -> None:
    Path(marker).touch()


class _Planted:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (_plant, (self.marker,))


def _convert(capsys, *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(["convert-checkpoint", *args])
    return exit_info.value.code, capsys.readouterr().err


def test_a_current_checkpoint_prints_the_message_and_exits_1_without_a_traceback(tmp_path):
    current = convert_legacy_checkpoint(FIXTURE, tmp_path / "v2")
    run = subprocess.run(
        [sys.executable, "-m", "lightning_moe_overlap", "convert-checkpoint", str(current), str(tmp_path / "v3")],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr
    assert f"{PROG}`convert_legacy_checkpoint`: {current} is not a version-1 sharded checkpoint" in run.stderr
    assert "version 2" in run.stderr and "load this one directly" in run.stderr
    assert not (tmp_path / "v3").exists()


@pytest.mark.parametrize(
    "case,match",
    [
        ("missing", r"no checkpoint at .*missing\. Check the path\."),
        ("file", r"is a file, not a version-1 sharded checkpoint directory"),
        ("existing", r"the destination .*existing exists; the conversion writes a new directory"),
        ("url", r"is a URL"),
    ],
)
def test_wrong_arguments_print_the_message_and_exit_1(tmp_path, capsys, case, match):
    source, destination = str(FIXTURE), str(tmp_path / "out")
    if case == "missing":
        source = str(tmp_path / "missing")
    elif case == "file":
        source = str(tmp_path / "model.ckpt")
        torch.save({"state_dict": {}}, source)
    elif case == "existing":
        destination = str(tmp_path / "existing")
        Path(destination).mkdir()
    else:
        destination = "s3://bucket/out"
    code, err = _convert(capsys, source, destination)
    assert code == 1 and err.startswith(PROG) and "Traceback" not in err
    assert re.search(match, err), err


def test_missing_arguments_exit_with_the_usage(capsys):
    code, err = _convert(capsys, str(FIXTURE))
    assert code == 2 and "usage: lightning-moe-overlap convert-checkpoint" in err and "destination" in err


def test_a_planted_source_is_refused_unless_no_weights_only_is_given(tmp_path, capsys):
    source, marker = tmp_path / "v1", tmp_path / "ran"
    shutil.copytree(FIXTURE, source)
    meta = torch.load(source / "meta.pt", weights_only=True)
    torch.save({**meta, "planted": _Planted(marker)}, source / "meta.pt")
    code, err = _convert(capsys, str(source), str(tmp_path / "v2"))
    assert code == 1 and f"the checkpoint file {source / 'meta.pt'} holds" in err and "--no-weights-only" in err
    assert not marker.exists() and not (tmp_path / "v2").exists()
    code, _ = _convert(capsys, str(source), str(tmp_path / "v2"), "--no-weights-only")
    assert code == 0 and marker.exists() and (tmp_path / "v2" / "COMMIT").is_file()
