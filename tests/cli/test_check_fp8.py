"""``--trainer.strategy.init_args.fp8``: LightningCLI reads the typed argument, and ``check`` reports the FP8 rules."""

from __future__ import annotations

from pathlib import Path

from lightning_moe_overlap.cli import check_main, parse_fit_config
from lightning_moe_overlap.strategy import MoEOverlapStrategy

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"


def test_the_fp8_argument_parses_and_builds_the_strategy() -> None:
    config, error = parse_fit_config([str(CONFIGS / "cpu.yaml")], ["--trainer.strategy.init_args.fp8", "rowwise"])
    assert error is None
    init_args = config["trainer"]["strategy"]["init_args"]
    assert init_args["fp8"] == "rowwise"
    assert MoEOverlapStrategy(**init_args).config.fp8 == "rowwise"


def test_check_reports_fp8_problems(capsys) -> None:
    code = check_main(["--config", str(CONFIGS / "cpu.yaml"), "--trainer.strategy.init_args.fp8", "rowwise"])
    out = capsys.readouterr().out
    assert code == 0 and out.strip().endswith("0 error(s), 0 warning(s)"), out
    code = check_main(["--config", str(CONFIGS / "cpu.yaml"), "--trainer.strategy.init_args.fp8=rowwise",
                       "--trainer.strategy.init_args.dispatcher=allgather", "--model.init_args.hidden_size=40"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "[fp8-dispatch-high-precision] warning" in out and "[fp8-dims] warning" in out, out
    assert "layers.1.mlp.experts (expert weight dims [40, 128, 256])" in out
    code = check_main(["--config", str(CONFIGS / "cpu.yaml"), "--trainer.strategy.init_args.fp8=rowwise",
                       "--trainer.strategy.init_args.expert_backend=te", "--no-machine-checks"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 1 and "[fp8-te-experts] NotImplementedError" in out, out
    code = check_main(["--config", str(CONFIGS / "cpu.yaml"), "--trainer.strategy.init_args.fp8=delayed"])
    out = capsys.readouterr().out
    assert code == 1 and "[config-parse]" in out and "delayed" in out  # the typed argument names the recipes


def test_mxfp8_parses_and_check_reports_its_high_precision_dispatch(capsys) -> None:
    config, error = parse_fit_config([str(CONFIGS / "cpu.yaml")], ["--trainer.strategy.init_args.fp8", "mxfp8"])
    assert error is None and config["trainer"]["strategy"]["init_args"]["fp8"] == "mxfp8"
    code = check_main(["--config", str(CONFIGS / "cpu.yaml"), "--trainer.strategy.init_args.fp8=mxfp8"])
    out = capsys.readouterr().out
    assert code == 0 and "[fp8-dispatch-high-precision] warning" in out, out
    assert out.strip().endswith("0 error(s), 1 warning(s)"), out
