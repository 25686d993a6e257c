"""``lightning-moe-overlap check``: a ``fit`` config validated for a world size without starting anything.

``check`` parses the config with the parser ``fit`` uses (every key ``fit`` accepts, every key it rejects),
applies every validation rule for a world size without starting any process or building the model's weights (the
model is instantiated on the meta device), and prints every problem with its fix. At ``pp > 1`` it also cuts the
meta model as the strategy will and prints the pipeline layout and the parameters one process of each pp rank
holds (``pipeline/report.py``). Where the model and the world size are known it prints the memory one process of
each pp rank needs (parameters, gradients, optimizer state, activations; ``cli/memory/``) and warns where it exceeds
the device's memory (``--memory-gb``, else the current GPU's).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from typing_extensions import override

import lightning_moe_overlap  # noqa: F401  (registers the strategy names)
from lightning_moe_overlap.cli.components import component_problems, expert_balance_problems
from lightning_moe_overlap.config import OverlapConfig
from lightning_moe_overlap.ep_choices import passing_ep_values
from lightning_moe_overlap.hf.pretrained import meta_from_pretrained
from lightning_moe_overlap.parallelize.materialize import build_on_meta, declare_weights
from lightning_moe_overlap.validation import (
    OWNER,
    Problem,
    check_config,
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

from lightning_moe_overlap.cli.fit import _REGISTERED, _TraceArgs


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
    memory: str | None = None


def collect_problems(
    config: dict[str, Any], world_size: int | None = None, *, machine_checks: bool = True
) -> list[Problem]:
    """Every validation problem of a parsed ``fit`` config (see :func:`parse_fit_config`), for ``world_size``
    processes (default: devices x num_nodes).

    ``machine_checks=False`` skips the rules about this machine (installed DeepEP, CUDA), to check a GPU job's
    config from another machine.
    """
    return run_checks(config, world_size, machine_checks=machine_checks).problems


def run_checks(
    config: dict[str, Any],
    world_size: int | None = None,
    *,
    machine_checks: bool = True,
    memory_limit: tuple[int | None, str] = (None, ""),
) -> CheckResult:
    """:func:`collect_problems`, plus the pipeline layout report at ``pp > 1`` and the memory table.

    ``memory_limit``: ``(bytes, where the number comes from)`` of the device memory per process; a pp rank whose
    estimate exceeds it is a warning (rule ``memory``). ``(None, ...)``: no comparison."""
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
    fp8 = cfg.fp8
    if machine_checks:
        problems += check_fp8_machine(fp8, "cuda" if trainer.get("accelerator") in ("gpu", "cuda") else "cpu")
    problems += check_launch(cfg, _batch_size(config.get("data")), config.get("ckpt_path"))
    report = memory = None
    if model_problem is not None:
        problems.append(model_problem)
    else:
        problems += weights_problems(model) + check_fp8_model(fp8, model)
    if model_problem is None and experts is not None:
        model_parallel = 0 if rule_sizes(cfg) else cfg.pp * cfg.cp * cfg.tp
        known = world is not None and model_parallel and world % model_parallel == 0
        ep_span = world // cfg.pp if known else None
        problems += check_model(cfg, experts, ep_span, ep_choices)
        split = None
        if _pipeline_known(cfg, problems):
            report, found = pipeline_findings(cfg, model)
            problems += found
            split = _split(cfg, model) if not found else None
        if world is not None and (cfg.pp == 1 or split is not None) and not any(p.is_error for p in problems):
            memory, found = memory_findings(config, cfg, model, world, split, memory_limit)
            problems += found
    problems += check_trainer(cfg, automatic_optimization=automatic)
    problems += component_problems(trainer) + expert_balance_problems(cfg, trainer)
    return CheckResult(problems, report, memory)


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
    from lightning_moe_overlap.parallelize.held_tensors import global_shapes

    try:
        for weights in as_hf_weights_list(getattr(model, "hf_weights", None), f"`{type(model).__name__}`"):
            weights.check(global_shapes(model))
    except (ValueError, TypeError, OSError) as err:
        return [Problem("hf-weights", f"`check`: the weights the model declares would not load: {err}")]
    return []


def _model_structure(model: Any) -> tuple[bool, dict[str, int]]:
    from lightning_moe_overlap.moe.model_handle import MoEModelHandle

    return model.automatic_optimization, dict(MoEModelHandle(model).experts_per_block())


def _pipeline_known(cfg: OverlapConfig, problems: list[Problem]) -> bool:
    """``pp > 1`` with sizes and a layout string the rules accept (else the layout cannot be built)."""
    return not rule_sizes(cfg) and cfg.pp > 1 and not any(p.rule == "pipeline-layout" for p in problems)


def pipeline_findings(cfg: OverlapConfig, model: Any) -> tuple[str | None, list[Problem]]:
    """At ``pp > 1``: cut the (meta) model as the strategy will, and report the layout, or why it cannot be cut.

    Findings: ``pipeline-splitter`` (no splitter knows the model, or it does not say its number of layers),
    ``pipeline-layers`` (the layers do not fit the chunks: the message suggests a layout), ``pipeline-split`` (the
    splitter's result breaks a rule of ``split_model``)."""
    from lightning_moe_overlap.config.pipeline_layout import build_layout
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


def _split(cfg: OverlapConfig, model: Any) -> Any:
    """The meta model cut as the strategy will (:func:`pipeline_findings` found that it can be)."""
    from lightning_moe_overlap.config.pipeline_layout import build_layout
    from lightning_moe_overlap.pipeline.report import placement_for
    from lightning_moe_overlap.pipeline.split import split_model
    from lightning_moe_overlap.pipeline.splitters import count_layers

    placement = placement_for(cfg.resolved_schedule)
    layout = build_layout(count_layers(model), cfg.pp, cfg.resolved_vpp, cfg.pipeline_layout, placement=placement)
    return split_model(model, layout)


def memory_findings(
    config: dict[str, Any], cfg: OverlapConfig, model: Any, world: int, split: Any, limit: tuple[int | None, str]
) -> tuple[str | None, list[Problem]]:
    """The memory table (``cli/memory/``) and a ``memory`` warning per pp rank above ``limit``; a failure of the
    estimate is a line of the table's place, never a traceback."""
    from lightning_moe_overlap.cli.memory import estimate_memory, memory_table, memory_warnings, settings_from_config

    try:
        rows, notes = estimate_memory(model, cfg, settings_from_config(config, world), split)
    except Exception as err:  # noqa: BLE001 - the estimate reads the user's model: a note, never a traceback
        return f"Memory per process: not estimated ({type(err).__name__}: {err})", []
    warnings_ = memory_warnings(rows, *limit)
    return memory_table(rows, notes), [Problem("memory", w.removeprefix("warning: "), None) for w in warnings_]


def _memory_gb(text: str) -> float:
    from lightning_moe_overlap.cli.memory.table import parse_memory_gb

    try:
        return parse_memory_gb(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


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
    parser.add_argument(
        "--memory-gb", type=_memory_gb, default=None,
        help="device memory per process in GiB to compare the memory estimate with (default: the current GPU's, "
        "when CUDA is available)",
    )  # fmt: skip
    args, overrides = parser.parse_known_args(argv)
    config, parse_error = parse_fit_config(args.config, overrides)
    if parse_error is not None:
        problems = [parse_error]
    else:
        assert config is not None
        from lightning_moe_overlap.cli.memory import device_memory_bytes

        result = run_checks(config, args.world_size, machine_checks=not args.no_machine_checks,
                            memory_limit=device_memory_bytes(args.memory_gb))  # fmt: skip
        problems = result.problems
        for text in (result.pipeline, result.memory):
            if text is not None:
                print(text)
    errors = [p for p in problems if p.is_error]
    for p in problems:
        print(p)
    print(f"{len(errors)} error(s), {len(problems) - len(errors)} warning(s)")
    return 1 if errors else 0
