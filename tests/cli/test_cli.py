"""The console script end to end, in subprocesses: fit from each CPU YAML, both strategy forms, print_config, check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"
SHORT = ["--trainer.max_steps=3", "--trainer.devices=2", "--trainer.val_check_interval=3"]


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lightning_moe_overlap", *args], capture_output=True, text=True, timeout=timeout
    )


def _console(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("lightning-moe-overlap")
    return subprocess.run([str(script), *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.long  # the console script also runs the default `fit` of test_cli_fit_trace_step_writes_the_timeline
def test_cli_fit_cpu_yaml_class_path_form(tmp_path):
    out = _console("fit", "--config", str(CONFIGS / "cpu.yaml"), *SHORT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=3` reached." in out.stderr + out.stdout
    assert "args parameter" not in out.stderr  # the console script does not pass sys.argv twice
    assert "Warning" not in out.stderr and "warn" not in out.stderr.lower(), out.stderr[-3000:]
    assert not (tmp_path / "config.yaml").exists()  # `logger: false`: the run has no log directory, no stray file


def test_cli_fit_saves_config_into_the_loggers_directory(tmp_path):
    out = _run(
        "fit", "--config", str(CONFIGS / "cpu.yaml"), *SHORT, "--trainer.logger=CSVLogger",
        f"--trainer.logger.save_dir={tmp_path / 'logs'}",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert not (tmp_path / "config.yaml").exists()
    saved = list((tmp_path / "logs").rglob("config.yaml"))
    assert [p.parent.name for p in saved] == ["version_0"], saved


@pytest.mark.long  # the pipeline at pp=2 on 4 processes: tests/distributed/test_pipeline_strategy.py
def test_cli_fit_cpu_pp_yaml_pipeline_on_four_processes():
    """The pipeline example (pp=2, vpp=2, ep=2 on 4 processes, interleaved 1F1B with overlap) trains from the CLI."""
    out = _console("fit", "--config", str(CONFIGS / "cpu_pp.yaml"), "--trainer.max_steps=2", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in out.stderr + out.stdout


def test_cli_help_lists_every_subcommand_and_the_trace_options():
    out = _console("--help", timeout=120)
    assert out.returncode == 0, out.stderr
    assert "args parameter" not in out.stderr
    lines = out.stdout.splitlines()
    names = ["fit", "validate", "test", "predict", "check", "convert-checkpoint", "consolidate-checkpoint", "export-hf"]
    for name in [*names, "--trace_step N", "--trace_dir DIR"]:
        (i,) = [i for i, line in enumerate(lines) if line.split()[:len(name.split())] == name.split()]
        described = lines[i][len(lines[i].split(name, 1)[0]) + len(name):].strip() or lines[i + 1].strip()
        assert len(described) > 10, (name, out.stdout)  # a description on its line or the next


@pytest.mark.parametrize("name", ["check", "convert-checkpoint", "consolidate-checkpoint"])
def test_cli_help_of_each_added_subcommand(name):
    out = _run(name, "--help", timeout=120)
    assert out.returncode == 0 and f"usage: lightning-moe-overlap {name}" in out.stdout, out.stderr


def test_cli_fit_help_lists_the_trace_options():
    out = _run("fit", "--help", timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--trace_step TRACE_STEP" in out.stdout and "--trace_dir TRACE_DIR" in out.stdout


@pytest.mark.long  # the config parses in the default run (print_config, check); the fit of cpu.yaml runs there too
def test_cli_fit_hf_yaml_with_registered_strategy_name():
    out = _run(
        "fit", "--config", str(CONFIGS / "cpu_hf_qwen3.yaml"), "--trainer.strategy=moe_overlap",
        "--trainer.max_steps=2", "--trainer.devices=2",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in out.stderr + out.stdout


@pytest.mark.parametrize("name", ["cpu.yaml", "cpu_pp.yaml", "cpu_hf_qwen3.yaml", "gpu.yaml", "gpu_multinode.yaml"])
def test_cli_print_config_resolves_the_strategy(name):
    out = _run("fit", "--config", str(CONFIGS / name), "--print_config", timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "class_path: lightning_moe_overlap.MoEOverlapStrategy" in out.stdout
    assert "num_microbatches:" in out.stdout and "dispatcher:" in out.stdout


def test_cli_check_valid_config_exits_zero():
    out = _run("check", "--config", str(CONFIGS / "cpu.yaml"), timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().endswith("0 error(s), 0 warning(s)")


def test_cli_check_multinode_config_for_64_ranks_without_machine_checks():
    out = _run(
        "check", "--config", str(CONFIGS / "gpu_multinode.yaml"), "--world-size", "64", "--no-machine-checks",
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[pipeline-without-pp] warning" in out.stdout and "0 error(s), 1 warning(s)" in out.stdout


def test_cli_check_invalid_config_lists_every_problem_and_fails():
    out = _run("check", "--config", str(ROOT / "tests" / "data" / "invalid.yaml"), timeout=120)
    assert out.returncode == 1
    for rule in (
        "flex-backend-without-flex", "shared-expert-overlap", "ep-divides-dp-cp", "experts-divisible-by-ep",
    ):
        assert f"[{rule}]" in out.stdout, rule
    assert "accumulate" not in out.stdout and "4 error(s)" in out.stdout


@pytest.mark.long  # the timeline callback itself runs in tests/distributed/test_monitor.py
@pytest.mark.parametrize("where", ["command line", "config file"])
def test_cli_fit_trace_step_writes_the_timeline(tmp_path, where):
    trace = ["--trace_step", "1", "--trace_dir", "tl"]
    if where == "config file":
        (tmp_path / "trace.yaml").write_text("trace_step: 1\ntrace_dir: tl\n")
        trace = ["--config", str(tmp_path / "trace.yaml")]
    out = _console("fit", "--config", str(CONFIGS / "cpu.yaml"), *SHORT, *trace)  # the console script
    assert out.returncode == 0, out.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=3` reached." in out.stderr + out.stdout
    import json

    trace = json.loads((tmp_path / "tl" / "step1.trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    assert {e["name"] for e in trace["traceEvents"] if e.get("cat") == "compute"} == {"F0", "F1", "B0", "B1"}


def test_cli_trace_dir_without_trace_step_is_refused():
    from lightning_moe_overlap.cli import pop_trace_args

    assert pop_trace_args(["fit", "--trace_step", "3"])[0] == ["fit"]
    with pytest.raises(ValueError, match="`--trace_dir tl` was given without `--trace_step`"):
        pop_trace_args(["fit", "--trace_dir", "tl"])
