"""`check` parses with the parser `fit` uses and reports every problem as a finding, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_moe_overlap.cli import check_main, collect_problems, parse_fit_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"


def _check(capsys, *argv: str) -> tuple[int, str]:
    code = check_main(list(argv))
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    return code, out.out


def test_documented_strategy_keys_parse(capsys):
    code, out = _check(capsys, "--config", str(CONFIGS / "cpu.yaml"), "--trainer.strategy.init_args.checkpoint_format=consolidated")
    assert code == 0 and out.strip().endswith("0 error(s), 0 warning(s)"), out


@pytest.mark.parametrize(
    "override,match",
    [
        ("--trainer.strategy.init_args.bogus=1", r"Option 'bogus' is not accepted"),
        ("--trainer.bogus=1", r"unrecognized arguments: --trainer.bogus=1"),
        ("--model.init_args.bogus=1", r"bogus"),
    ],
)
def test_keys_fit_rejects_are_findings(capsys, override, match):
    code, out = _check(capsys, "--config", str(CONFIGS / "cpu.yaml"), override)
    assert code == 1 and "[config-parse] ValueError: `fit` would reject this config" in out, out
    assert __import__("re").search(match, out), out
    assert out.strip().endswith("1 error(s), 0 warning(s)")


def test_unknown_key_in_a_yaml_file_is_a_finding(capsys, tmp_path):
    extra = tmp_path / "extra.yaml"
    extra.write_text("trainer:\n  strategy:\n    class_path: lightning_moe_overlap.MoEOverlapStrategy\n    init_args:\n      bogus: 1\n")
    code, out = _check(capsys, "--config", str(CONFIGS / "cpu.yaml"), "--config", str(extra))
    assert code == 1 and "[config-parse]" in out and "bogus" in out


def test_gpu_config_on_a_machine_without_cuda(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, out = _check(capsys, "--config", str(CONFIGS / "gpu.yaml"))
    assert code == 1 and "[cuda-unavailable] RuntimeError" in out
    code, out = _check(capsys, "--config", str(CONFIGS / "gpu.yaml"), "--no-machine-checks")
    assert code == 0, out


def test_batch_size_the_microbatches_do_not_split(capsys):
    code, out = _check(capsys, "--config", str(CONFIGS / "cpu.yaml"), "--data.init_args.batch_size=9")
    assert code == 1 and "[batch-size-microbatches] ValueError" in out and "batch_size=9" in out


def test_missing_checkpoint_path(capsys, tmp_path):
    code, out = _check(capsys, "--config", str(CONFIGS / "cpu.yaml"), f"--ckpt_path={tmp_path / 'none.ckpt'}")
    assert code == 1 and "[ckpt-path-exists] FileNotFoundError" in out


def test_registered_strategy_name_and_unknown_devices(capsys):
    code, out = _check(capsys, "--config", str(CONFIGS / "cpu.yaml"), "--trainer.strategy=moe_overlap")
    assert code == 0, out  # the one-liner's defaults: no overlap warning with one micro-batch
    code, out = _check(capsys, "--config", str(CONFIGS / "cpu.yaml"), "--trainer.devices=auto")
    assert code == 1 and "[world-size-unknown]" in out and "--world-size N" in out
    code, out = _check(capsys, "--config", str(CONFIGS / "cpu.yaml"), "--trainer.devices=auto", "--world-size", "4")
    assert code == 0, out


def test_experts_error_suggests_only_ep_values_valid_for_the_world(capsys):
    config, error = parse_fit_config([str(CONFIGS / "cpu.yaml")], ["--trainer.strategy.init_args.ep=3"])
    assert error is None and config is not None
    found = {p.rule: p.message for p in collect_problems(config, 4)}
    assert "ep=3 does not divide dp*cp=4" in found["ep-divides-dp-cp"]
    assert "Choose ep among [1, 2, 4]" in found["experts-divisible-by-ep"]  # 8 experts, 4 processes: not 8
