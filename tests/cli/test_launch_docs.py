"""Every command of docs/launch.md is exercised: run on CPU here or by the named test, or, where it needs GPUs or
a cluster, its config is checked with `lightning-moe-overlap check` for the world size it names."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from lightning_moe_overlap.cli import check_main

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "launch.md"
RUN_ELSEWHERE = {
    "python examples/train_moe_gpt.py": "tests/unit/test_docs.py::test_readme_main_job_runs_as_pasted",
    "lightning-moe-overlap fit --config examples/configs/cpu.yaml": "tests/cli/test_cli.py::test_cli_fit_cpu_yaml_class_path_form",
    # the same subcommand on a version-1 fixture
    "lightning-moe-overlap convert-checkpoint ckpts/old.ckpt ckpts/old-v2.ckpt":
        "tests/unit/test_checkpoint.py::test_a_version_1_directory_converts_and_loads_bitwise",
    "lightning-moe-overlap consolidate-checkpoint ckpts/epoch=0-step=100.ckpt final.ckpt":
        "tests/cli/test_consolidate_checkpoint_cli.py::test_a_two_process_checkpoint_consolidates_into_the_runs_full_state",
}
SHORT = ["--trainer.max_steps=2", "--trainer.limit_val_batches=0"]


def _commands() -> list[tuple[str, bool]]:
    """``(command, runs_here)`` for every command line of the doc's bash blocks (comments dropped)."""
    out, lines = [], DOC.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.strip() == "```bash":
            marked = i > 0 and lines[i - 1].startswith("<!-- needs")
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            for cmd in lines[i + 1 : end]:
                cmd = cmd.split("  #")[0].strip()
                if cmd:
                    out.append((cmd, not marked))
    return out


COMMANDS = _commands()


def test_the_doc_has_the_commands_it_promises():
    text = " ".join(c for c, _ in COMMANDS)
    for needle in ("torchrun --standalone", "torchrun --nnodes", "srun ", "lightning-moe-overlap check"):
        assert needle in text, needle


def test_install_commands_name_extras_that_exist():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for cmd, _ in COMMANDS:
        if cmd.startswith("pip install"):
            spec = shlex.split(cmd)[-1]
            for extra in spec.partition("[")[2].rstrip("]").split(",") if "[" in spec else []:
                assert extra in extras, cmd
    assert any("tensorboard" in d for d in extras["loggers"])


@pytest.mark.parametrize("cmd", [c for c, here in COMMANDS if here and c.startswith("lightning-moe-overlap check")])
def test_check_commands(cmd, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert check_main(shlex.split(cmd)[2:]) == 0, capsys.readouterr().out


def test_cpu_commands_run_here_or_in_the_named_test():
    for cmd, here in COMMANDS:
        if here and not cmd.startswith(("pip install", "lightning-moe-overlap check", "torchrun --standalone")):
            assert cmd in RUN_ELSEWHERE, f"{cmd!r} is run by no test"


@pytest.mark.parametrize("cmd", [c for c, here in COMMANDS if here and c.startswith("torchrun --standalone")])
def test_torchrun_on_cpu(cmd, tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    argv = [str(torchrun), *shlex.split(cmd)[1:], *SHORT]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in out.stdout + out.stderr
    assert not (ROOT / "config.yaml").exists()


@pytest.mark.parametrize("cmd", [c for c, here in COMMANDS if not here])
def test_cluster_commands_configs_pass_check_for_their_world_size(cmd, monkeypatch, capsys):
    argv = shlex.split(cmd.replace("$N", "2").replace("$HEAD", "head"))
    config = argv[argv.index("--config") + 1]
    overrides = [a for a in argv if a.startswith("--trainer.")]
    monkeypatch.chdir(ROOT)
    code = check_main(["--config", config, *overrides, "--world-size", "16", "--no-machine-checks"])
    assert code == 0, capsys.readouterr().out
