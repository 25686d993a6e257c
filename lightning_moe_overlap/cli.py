"""The ``lightning-moe-overlap`` console script: LightningCLI with the strategy registered, plus ``check``.

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
import importlib
import logging
import sys
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from typing_extensions import override

import lightning_moe_overlap  # noqa: F401  (registers the strategy names)
from lightning_moe_overlap.cli_components import MissingExtraError, component_problems, raise_missing_extras
from lightning_moe_overlap.config import OverlapConfig
from lightning_moe_overlap.ep_choices import passing_ep_values
from lightning_moe_overlap.hf.pretrained import meta_from_pretrained
from lightning_moe_overlap.parallel.materialize import build_on_meta, declare_weights
from lightning_moe_overlap.strategy import MoEOverlapStrategy
from lightning_moe_overlap.validation import (
    OWNER,
    Problem,
    check_config,
    check_fp8,
    check_fp8_machine,
    check_fp8_model,
    check_flex,
    check_launch,
    check_machine,
    check_model,
    check_trainer,
    check_world,
    rule_sizes,
)

_REGISTERED = {"moe_overlap": {}, "moe_overlap_spawn": {"start_method": "spawn"}}
DESCRIPTION = (
    "Train Mixture-of-Experts models with expert-parallel all-to-all overlap. Sub-commands: fit, validate, test, "
    "predict (LightningCLI); check, convert-checkpoint and consolidate-checkpoint (`lightning-moe-overlap --help`)."
)


class SaveConfigToLogDir(SaveConfigCallback):
    """Saves the run's ``config.yaml`` into the logger's directory; without a logger, the run has none: no file."""

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if trainer.logger is None:
            return
        super().setup(trainer, pl_module, stage)


class _TraceArgs(LightningCLI):
    """``--trace_step`` / ``--trace_dir`` as keys of the ``fit`` parser: listed by ``fit --help``, accepted in a
    config file. On the command line :func:`main` takes them out first (:func:`pop_trace_args`)."""

    @override
    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_argument(
            "--trace_step", type=Optional[int], default=None,
            help="Write a timeline (Chrome trace and PNG) of this global step (OverlapTimeline callback).",
        )  # fmt: skip
        parser.add_argument(
            "--trace_dir", type=Optional[str], default=None,
            help="Where --trace_step writes (default <default_root_dir>/timeline).",
        )  # fmt: skip


class _RunCLI(_TraceArgs):
    """LightningCLI that refuses a logger or callback whose optional package is missing, in one line, before
    jsonargparse tries to build it (its error is a traceback naming no extra), and adds the timeline callback a
    config file's ``trace_step`` asks for."""

    @override
    def before_instantiate_classes(self) -> None:
        config = (self.config[self.subcommand] if self.subcommand else self.config).as_dict()
        raise_missing_extras(config.get("trainer") or {})
        traced = trace_defaults(config.get("trace_step"), config.get("trace_dir"))
        callbacks = self.trainer_defaults.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
        if traced is not None and not any(type(c).__name__ == "OverlapTimeline" for c in callbacks):
            # (the command line's --trace_step, taken out by `main`, wins over a config file's)
            self.trainer_defaults = {**self.trainer_defaults, "callbacks": [*callbacks, *traced["callbacks"]]}


def run_cli(args: Sequence[str] | None = None, trainer_defaults: dict[str, Any] | None = None) -> LightningCLI:
    """LightningCLI over any LightningModule / LightningDataModule, chosen by class path in the config.

    ``args=None`` reads the command line (``sys.argv``), as the console script does; ``trainer_defaults`` adds
    to the Trainer's defaults (the ``--trace_step`` callback).

    Raises:
        MissingExtraError: (an ``ImportError``) a logger or callback needs an optional package that is missing.
    """
    return _RunCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_callback=SaveConfigToLogDir,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"description": DESCRIPTION},
        trainer_defaults=trainer_defaults,
        args=args,
    )


def pop_trace_args(argv: list[str]) -> tuple[list[str], dict[str, Any] | None]:
    """Take ``--trace_step N`` / ``--trace_dir D`` out of ``argv``; returns the rest and the trainer defaults that
    add the :class:`OverlapTimeline` callback (``None`` without ``--trace_step``)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--trace_step", type=int, default=None)
    parser.add_argument("--trace_dir", default=None)
    known, rest = parser.parse_known_args(argv)
    return rest, trace_defaults(known.trace_step, known.trace_dir)


def trace_defaults(step: int | None, dirpath: str | None) -> dict[str, Any] | None:
    """The trainer defaults that add the :class:`OverlapTimeline` of global step ``step`` (``None`` without one)."""
    from lightning_moe_overlap.callbacks import OverlapTimeline

    if step is None:
        if dirpath is not None:
            raise ValueError(
                f"`--trace_dir {dirpath}` was given without `--trace_step`; the directory is where the "
                "timeline of that step goes. Add `--trace_step N` (a global step), or drop `--trace_dir`."
            )
        return None
    return {"callbacks": [OverlapTimeline(step=step, dirpath=dirpath)]}


# -- check: the fit parser, without instantiating anything --------------------------------------------------------
class _ParseOnlyCLI(_TraceArgs):
    """Parses and validates a ``fit`` command line like :func:`run_cli`, and stops there."""

    @override
    def instantiate_classes(self) -> None:
        pass

    @override
    def after_instantiate_classes(self) -> None:
        self.subcommand = None  # nothing to run


@contextmanager
def _quiet_seed_log() -> Iterator[None]:
    seed_log = logging.getLogger("lightning.fabric.utilities.seed")
    level = seed_log.level
    seed_log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        seed_log.setLevel(level)


def parse_fit_config(
    configs: Sequence[str], overrides: Sequence[str] = ()
) -> tuple[dict[str, Any] | None, Problem | None]:
    """The ``fit`` config as ``fit`` would see it (defaults filled in), or the parse error as a finding."""
    args = ["fit", *(a for path in configs for a in ("--config", path)), *overrides]
    try:
        with _quiet_seed_log(), warnings.catch_warnings():
            # `args` is the command line `check` was given, rebuilt for `fit`: not a second command line
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
            cli = _ParseOnlyCLI(
                subclass_mode_model=True,
                subclass_mode_data=True,
                args=args,
                load_from_checkpoint_support=False,
                seed_everything_default=False,  # nothing runs: no "No seed found" warning
                parser_kwargs={"exit_on_error": False, "fit": {"exit_on_error": False}},
            )
    except (argparse.ArgumentError, SystemExit, ValueError, TypeError, ImportError) as err:
        text = str(err).strip() or type(err).__name__
        return None, Problem(
            "config-parse",
            f"`fit` would reject this config: {text}\n  Fix the key or value named above "
            "(`lightning-moe-overlap fit --config ... --print_config` shows every key `fit` accepts).",
        )
    return cli.config["fit"].as_dict(), None


def _strategy_config(strategy: Any) -> OverlapConfig | None:
    """The OverlapConfig the trainer section asks for, or None when the strategy is not this package's."""
    if isinstance(strategy, str):
        if strategy not in _REGISTERED:
            return None
        return OverlapConfig(**{"overlap": None, **_REGISTERED[strategy]})
    if isinstance(strategy, dict) and str(strategy.get("class_path", "")).endswith("MoEOverlapStrategy"):
        init_args = dict(strategy.get("init_args") or {})
        fields = {k: v for k, v in init_args.items() if k in OverlapConfig.__dataclass_fields__}
        return OverlapConfig(**{"overlap": None, **fields})
    return None


def _strategy_fp8(strategy: Any) -> Any:
    """The ``fp8`` init arg of a ``MoEOverlapStrategy`` class-path section (None otherwise)."""
    if isinstance(strategy, dict):
        return (strategy.get("init_args") or {}).get("fp8")
    return None


def _instantiate(spec: dict[str, Any]) -> Any:
    module_name, _, cls_name = spec["class_path"].rpartition(".")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(**(spec.get("init_args") or {}))


def _world_size(trainer: dict[str, Any], override: int | None) -> int | None:
    if override is not None:
        return override
    devices = trainer.get("devices", 1)
    if isinstance(devices, str) and devices.isdigit():
        devices = int(devices)
    if not isinstance(devices, int) or devices < 1:
        return None
    return devices * int(trainer.get("num_nodes") or 1)


def _batch_size(data: Any) -> int | None:
    if isinstance(data, dict):
        value = (data.get("init_args") or {}).get("batch_size")
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    return None


@dataclass
class CheckResult:
    """What ``check`` finds: the problems, and at ``pp > 1`` the pipeline layout report (None otherwise)."""

    problems: list[Problem]
    pipeline: str | None = None


def collect_problems(
    config: dict[str, Any], world_size: int | None = None, *, machine_checks: bool = True
) -> list[Problem]:
    """Every validation problem of a parsed ``fit`` config (see :func:`parse_fit_config`), for ``world_size``
    processes (default: devices x num_nodes).

    ``machine_checks=False`` skips the rules about this machine (installed DeepEP, CUDA), to check a GPU job's
    config from another machine.
    """
    return run_checks(config, world_size, machine_checks=machine_checks).problems


def run_checks(config: dict[str, Any], world_size: int | None = None, *, machine_checks: bool = True) -> CheckResult:
    """:func:`collect_problems`, plus the pipeline layout report at ``pp > 1``."""
    trainer = config.get("trainer") or {}
    cfg = _strategy_config(trainer.get("strategy", "auto"))
    if cfg is None:
        return CheckResult(
            [Problem("strategy", "`check`: trainer.strategy is not `MoEOverlapStrategy` (or `moe_overlap`).")]
        )
    problems = check_config(cfg)
    world = _world_size(trainer, world_size)
    devices = trainer.get("devices")
    per_node = devices if isinstance(devices, int) and not isinstance(devices, bool) else None
    built, model_problem = _meta_model_or_problem(config.get("model"))
    model, automatic, experts = built if built is not None else (None, True, None)
    # where the model is known, suggest only the ep values that pass every rule on ep (not each rule's own)
    ep_choices = None if experts is None else passing_ep_values(cfg, world, experts, devices_per_node=per_node)
    if world is None:
        problems.append(
            Problem(
                "world-size-unknown",
                f"`check`: trainer.devices={trainer.get('devices')!r} is not a number of devices, so the world size "
                "is unknown. Pass `--world-size N`.",
            )
        )
    else:
        problems += check_world(cfg, world, ep_choices)
    problems += check_flex(cfg, devices_per_node=per_node, precision=trainer.get("precision"))
    if machine_checks:
        accelerator = trainer.get("accelerator", "auto")
        problems += check_machine(cfg, "cuda" if accelerator in ("gpu", "cuda") else "cpu")
    fp8 = _strategy_fp8(trainer.get("strategy"))
    problems += check_fp8(fp8, cfg)
    if machine_checks:
        problems += check_fp8_machine(fp8, "cuda" if trainer.get("accelerator") in ("gpu", "cuda") else "cpu")
    problems += check_launch(cfg, _batch_size(config.get("data")), config.get("ckpt_path"))
    report = None
    if model_problem is not None:
        problems.append(model_problem)
    else:
        problems += weights_problems(model) + check_fp8_model(fp8, model)
    if model_problem is None and experts is not None:
        model_parallel = 0 if rule_sizes(cfg) else cfg.pp * cfg.cp * cfg.tp
        known = world is not None and model_parallel and world % model_parallel == 0
        ep_span = world // cfg.pp if known else None
        problems += check_model(cfg, experts, ep_span, ep_choices)
        if _pipeline_known(cfg, problems):
            report, found = pipeline_findings(cfg, model)
            problems += found
    problems += check_trainer(cfg, automatic_optimization=automatic)
    problems += component_problems(trainer)
    return CheckResult(problems, report)


def _meta_model_or_problem(model_spec: Any) -> tuple[tuple[Any, bool, dict[str, int]] | None, Problem | None]:
    """``(model built on the meta device, automatic_optimization, experts per MoE block)`` (None without a
    ``class_path``), or why the model could not be built."""
    if not (isinstance(model_spec, dict) and "class_path" in model_spec):
        return None, None
    try:
        with torch.device("meta"):
            model = _instantiate(model_spec)
            if build_on_meta(model):  # what the strategy builds under the meta device (a no-op for most modules)
                with meta_from_pretrained(torch.device("cpu")) as calls:  # its `from_pretrained` calls, as it does
                    model.configure_model()
                declare_weights(model, calls.weights(model))
        automatic, experts = _model_structure(model)
    except Exception as err:  # noqa: BLE001 - a finding, never a traceback
        return None, Problem(
            "model", f"`check`: building the model on the meta device failed: {type(err).__name__}: {err}"
        )
    return (model, automatic, experts), None


def weights_problems(model: Any) -> list[Problem]:
    """The published checkpoint the model declares (``hf_weights``) against the model built on meta: the files'
    headers only, the errors the load would raise at setup (``hf-weights``)."""
    from lightning_moe_overlap.hf.load import as_hf_weights_list
    from lightning_moe_overlap.parallel.held import global_shapes

    try:
        for weights in as_hf_weights_list(getattr(model, "hf_weights", None), f"`{type(model).__name__}`"):
            weights.check(global_shapes(model))
    except (ValueError, TypeError, OSError) as err:
        return [Problem("hf-weights", f"`check`: the weights the model declares would not load: {err}")]
    return []


def _model_structure(model: Any) -> tuple[bool, dict[str, int]]:
    from lightning_moe_overlap.moe.handle import MoEModelHandle

    return model.automatic_optimization, dict(MoEModelHandle(model).experts_per_block())


def _pipeline_known(cfg: OverlapConfig, problems: list[Problem]) -> bool:
    """``pp > 1`` with sizes and a layout string the rules accept (else the layout cannot be built)."""
    return not rule_sizes(cfg) and cfg.pp > 1 and not any(p.rule == "pipeline-layout" for p in problems)


def pipeline_findings(cfg: OverlapConfig, model: Any) -> tuple[str | None, list[Problem]]:
    """At ``pp > 1``: cut the (meta) model as the strategy will, and report the layout, or why it cannot be cut.

    Findings: ``pipeline-splitter`` (no splitter knows the model, or it does not say its number of layers),
    ``pipeline-layers`` (the layers do not fit the chunks: the message suggests a layout), ``pipeline-split`` (the
    splitter's result breaks a rule of ``split_model``)."""
    from lightning_moe_overlap.pipeline.layout import build_layout
    from lightning_moe_overlap.pipeline.report import layout_report, placement_for
    from lightning_moe_overlap.pipeline.split import split_model
    from lightning_moe_overlap.pipeline.splitters import count_layers

    schedule = cfg.resolved_schedule
    try:
        num_layers = count_layers(model)
    except (TypeError, ValueError) as err:
        return None, [Problem("pipeline-splitter", f"{OWNER} with `pp={cfg.pp}`: {err}", type(err))]
    try:
        layout = build_layout(
            num_layers, cfg.pp, cfg.resolved_vpp, cfg.pipeline_layout, placement=placement_for(schedule)
        )
    except ValueError as err:
        return None, [Problem("pipeline-layers", f"{OWNER}: {err}")]
    try:
        split = split_model(model, layout)
    except Exception as err:  # noqa: BLE001 - the splitter may be the user's code: a finding, never a traceback
        text = err.args[0] if isinstance(err, KeyError) and err.args else err
        return None, [Problem("pipeline-split", f"{OWNER} with `pp={cfg.pp}`: {text}", type(err))]
    return layout_report(split, cfg.ep, schedule=schedule), []


def check_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-moe-overlap check",
        description="Parse a `fit` config with the parser `fit` uses and apply every validation rule for a world "
        "size, without starting any process. Other `--section.key=value` arguments override the config as in `fit`.",
    )
    parser.add_argument("--config", "-c", required=True, action="append", help="YAML config file(s), merged in order")
    parser.add_argument("--world-size", type=int, default=None, help="processes (default: devices x num_nodes)")
    parser.add_argument(
        "--no-machine-checks", action="store_true", help="skip the rules about this machine (DeepEP, CUDA installed)"
    )
    args, overrides = parser.parse_known_args(argv)
    config, parse_error = parse_fit_config(args.config, overrides)
    if parse_error is not None:
        problems = [parse_error]
    else:
        assert config is not None
        result = run_checks(config, args.world_size, machine_checks=not args.no_machine_checks)
        problems = result.problems
        if result.pipeline is not None:
            print(result.pipeline)
    errors = [p for p in problems if p.is_error]
    for p in problems:
        print(p)
    print(f"{len(errors)} error(s), {len(problems) - len(errors)} warning(s)")
    return 1 if errors else 0


SUBCOMMANDS = {
    "fit": "train a model from a config (LightningCLI: --config, --trainer.*, --model.*, --data.*)",
    "validate": "run one evaluation epoch over the validation set (LightningCLI)",
    "test": "run one evaluation epoch over the test set (LightningCLI)",
    "predict": "run inference over the predict set (LightningCLI)",
    "check": "validate a fit config for a world size without starting anything (every rule, with its fix)",
    "convert-checkpoint": "convert a sharded checkpoint of format version 1 into version 2, in one process",
    "consolidate-checkpoint": "write a sharded checkpoint directory as one consolidated file, in one process",
    "export-hf": "write a checkpoint as a Hugging Face folder (config.json + safetensors), in one process",
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
        from lightning_moe_overlap.checkpoint.legacy import main as convert_main

        raise SystemExit(convert_main(command[1:]))
    if command and command[0] == "consolidate-checkpoint":
        from lightning_moe_overlap.checkpoint.consolidated import main as consolidate_main

        raise SystemExit(consolidate_main(command[1:]))
    if command and command[0] == "export-hf":
        from lightning_moe_overlap.hf.export import main as export_main

        raise SystemExit(export_main(command[1:]))
    try:
        _run(command, from_sys_argv=argv is None)
    except MissingExtraError as err:
        name = command[0] if command and not command[0].startswith("-") else "fit"
        print(f"lightning-moe-overlap {name}: error: {err}", file=sys.stderr)
        raise SystemExit(1) from None


def _run(command: list[str], *, from_sys_argv: bool) -> None:
    rest, trainer_defaults = pop_trace_args(command)
    if from_sys_argv and trainer_defaults is None:
        run_cli(None)  # LightningCLI reads sys.argv itself (no double-args warning)
        return
    # sys.argv keeps the trace flags: the launcher re-runs it for the other ranks, which need the same callback
    with warnings.catch_warnings():
        # `rest` is this command line less the trace flags: not a second command line
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        run_cli(rest, trainer_defaults)


__all__ = [
    "SUBCOMMANDS", "CheckResult", "MissingExtraError", "MoEOverlapStrategy", "SaveConfigToLogDir", "collect_problems",
    "main", "parse_fit_config", "pipeline_findings", "print_help", "run_checks", "run_cli",
]
