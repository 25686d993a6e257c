"""The ``lightning-moe-overlap`` console script, one module per subcommand: ``fit`` / ``validate`` / ``test`` /
``predict`` (``fit.py``: LightningCLI with the strategy registered), ``check`` (``check.py``), ``convert-checkpoint``,
``consolidate-checkpoint`` and ``export-hf`` (their modules of the same name); ``components.py`` checks the classes a
config names.

    lightning-moe-overlap fit --config examples/configs/cpu.yaml
    lightning-moe-overlap fit --config examples/configs/cpu.yaml --print_config
    lightning-moe-overlap check --config examples/configs/gpu_multinode.yaml --world-size 64 --no-machine-checks
    lightning-moe-overlap fit --config examples/configs/cpu.yaml --trace_step 2 --trace_dir timeline

``check`` parses the config with the parser ``fit`` uses (every key ``fit`` accepts, every key it rejects),
applies every validation rule for a world size without starting any process or building the model's weights (the
model is instantiated on the meta device), and prints every problem with its fix. At ``pp > 1`` it also cuts the
meta model as the strategy will and prints the pipeline layout and the parameters one process of each pp rank
holds (``pipeline/report.py``).

``--trace_step N`` (with ``fit``) adds an :class:`~lightning_moe_overlap.callbacks.OverlapTimeline` for global step
``N``: a Chrome trace and a PNG of that step on every rank, written to ``--trace_dir`` (default
``<default_root_dir>/timeline``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lightning_moe_overlap.cli.check import (
    CheckResult,
    check_main,
    collect_problems,
    parse_fit_config,
    pipeline_findings,
    run_checks,
)
from lightning_moe_overlap.cli.components import MissingExtraError
from lightning_moe_overlap.cli.fit import SaveConfigToLogDir, _run, pop_trace_args, run_cli, trace_defaults
from lightning_moe_overlap.strategy import MoEOverlapStrategy


SUBCOMMANDS = {
    "fit": "train a model from a config (LightningCLI: --config, --trainer.*, --model.*, --data.*)",
    "validate": "run one evaluation epoch over the validation set (LightningCLI)",
    "test": "run one evaluation epoch over the test set (LightningCLI)",
    "predict": "run inference over the predict set (LightningCLI)",
    "check": "validate a fit config for a world size without starting anything (every rule, with its fix)",
    "convert-checkpoint": "convert a sharded checkpoint of format version 1 into version 2, in one process",
    "consolidate-checkpoint": "write a sharded checkpoint directory as one consolidated file, in one process",
    "export-hf": "write a checkpoint as a Hugging Face folder (config.json + safetensors); torchrun reads it in parts",
}


def print_help() -> None:
    """The top-level help: every subcommand and the options this package adds to ``fit``, one line each."""
    parser = argparse.ArgumentParser(
        prog="lightning-moe-overlap",
        usage="%(prog)s SUBCOMMAND [options]  (fit: [--trace_step N [--trace_dir DIR]])",
        description="Train Mixture-of-Experts models with expert-parallel all-to-all overlap. "
        "`lightning-moe-overlap SUBCOMMAND --help` shows each subcommand's options.",
        add_help=False,
    )
    sub = parser.add_subparsers(title="subcommands", metavar="SUBCOMMAND")
    for name, text in SUBCOMMANDS.items():
        sub.add_parser(name, help=text)
    fit = parser.add_argument_group("options of fit, besides LightningCLI's")
    fit.add_argument("--trace_step", metavar="N", help="write a timeline (Chrome trace and PNG) of global step N")
    fit.add_argument(
        "--trace_dir", metavar="DIR", help="where --trace_step writes (default <default_root_dir>/timeline)"
    )
    parser.print_help()


def main(argv: Sequence[str] | None = None) -> None:
    command = list(sys.argv[1:] if argv is None else argv)
    if command[:1] in (["-h"], ["--help"]):
        print_help()
        raise SystemExit(0)
    if command and command[0] in ("check", "validate-config"):
        raise SystemExit(check_main(command[1:]))
    if command and command[0] == "convert-checkpoint":
        from lightning_moe_overlap.cli.convert_checkpoint import main as convert_main

        raise SystemExit(convert_main(command[1:]))
    if command and command[0] == "consolidate-checkpoint":
        from lightning_moe_overlap.cli.consolidate_checkpoint import main as consolidate_main

        raise SystemExit(consolidate_main(command[1:]))
    if command and command[0] == "export-hf":
        from lightning_moe_overlap.cli.export_hf import main as export_main

        raise SystemExit(export_main(command[1:]))
    try:
        _run(command, from_sys_argv=argv is None)
    except MissingExtraError as err:
        name = command[0] if command and not command[0].startswith("-") else "fit"
        print(f"lightning-moe-overlap {name}: error: {err}", file=sys.stderr)
        raise SystemExit(1) from None


__all__ = [
    "SUBCOMMANDS", "CheckResult", "MissingExtraError", "MoEOverlapStrategy", "SaveConfigToLogDir", "check_main",
    "collect_problems", "main", "parse_fit_config", "pipeline_findings", "pop_trace_args", "print_help", "run_checks",
    "run_cli", "trace_defaults",
]
