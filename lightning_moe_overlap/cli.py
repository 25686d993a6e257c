"""The ``lightning-moe-overlap`` console script: LightningCLI with the strategy registered, plus ``check``.

    lightning-moe-overlap fit --config examples/configs/cpu.yaml
    lightning-moe-overlap fit --config examples/configs/cpu.yaml --print_config
    lightning-moe-overlap check --config examples/configs/gpu_multinode.yaml --world-size 64
    lightning-moe-overlap fit --config examples/configs/cpu.yaml --trace_step 2 --trace_dir timeline

``check`` loads a config, applies every validation rule for a world size without starting any process or
building the model's weights (the model is instantiated on the meta device), and prints every problem with its fix.

``--trace_step N`` (with ``fit``) adds an :class:`~lightning_moe_overlap.callbacks.OverlapTimeline` for global step
``N``: a Chrome trace and a PNG of that step on every rank, written to ``--trace_dir`` (default
``<default_root_dir>/timeline``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

import torch
import yaml
from lightning.pytorch.cli import LightningCLI

import lightning_moe_overlap  # noqa: F401  (registers the strategy names)
from lightning_moe_overlap.config import OverlapConfig
from lightning_moe_overlap.strategy import MoEOverlapStrategy
from lightning_moe_overlap.validation import (
    Problem,
    check_config,
    check_machine,
    check_model,
    check_trainer,
    check_world,
)

_REGISTERED = {"moe_overlap": {}, "moe_overlap_spawn": {"start_method": "spawn"}}


def run_cli(args: Sequence[str] | None = None, trainer_defaults: dict[str, Any] | None = None) -> LightningCLI:
    """LightningCLI over any LightningModule / LightningDataModule, chosen by class path in the config."""
    return LightningCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        trainer_defaults=trainer_defaults,
        args=args,
    )


def pop_trace_args(argv: list[str]) -> tuple[list[str], dict[str, Any] | None]:
    """Take ``--trace_step N`` / ``--trace_dir D`` out of ``argv``; returns the rest and the trainer defaults that
    add the :class:`OverlapTimeline` callback (``None`` without ``--trace_step``)."""
    from lightning_moe_overlap.callbacks import OverlapTimeline

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--trace_step", type=int, default=None)
    parser.add_argument("--trace_dir", default=None)
    known, rest = parser.parse_known_args(argv)
    if known.trace_step is None:
        if known.trace_dir is not None:
            raise ValueError(
                f"`--trace_dir {known.trace_dir}` was given without `--trace_step`; the directory is where the "
                "timeline of that step goes. Add `--trace_step N` (a global step), or drop `--trace_dir`."
            )
        return rest, None
    return rest, {"callbacks": [OverlapTimeline(step=known.trace_step, dirpath=known.trace_dir)]}


# -- check ------------------------------------------------------------------------------------------------------
def _load(path: str) -> dict[str, Any]:
    with open(path) as f:
        return yaml.safe_load(f) or {}


def _strategy_config(strategy: Any) -> OverlapConfig | None:
    """The OverlapConfig the trainer section asks for, or None when the strategy is not this package's."""
    if isinstance(strategy, str):
        if strategy not in _REGISTERED:
            return None
        return OverlapConfig(**_REGISTERED[strategy])
    if isinstance(strategy, dict) and str(strategy.get("class_path", "")).endswith("MoEOverlapStrategy"):
        init_args = dict(strategy.get("init_args") or {})
        init_args.pop("timeout", None)
        fields = set(OverlapConfig.__dataclass_fields__)
        unknown = sorted(set(init_args) - fields)
        if unknown:
            raise ValueError(f"`check`: unknown `MoEOverlapStrategy` arguments {unknown}; valid: {sorted(fields)}.")
        return OverlapConfig(**init_args)
    return None


def _instantiate(spec: dict[str, Any]) -> Any:
    module_name, _, cls_name = spec["class_path"].rpartition(".")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(**(spec.get("init_args") or {}))


def _world_size(trainer: dict[str, Any], override: int | None) -> int:
    if override is not None:
        return override
    devices = trainer.get("devices", 1)
    if not isinstance(devices, int):
        raise ValueError(
            f"`check`: trainer.devices={devices!r} is not a number of devices; pass `--world-size N` explicitly."
        )
    return devices * int(trainer.get("num_nodes", 1))


def collect_problems(
    config: dict[str, Any], world_size: int | None = None, *, machine_checks: bool = True
) -> list[Problem]:
    """Every validation problem of a LightningCLI config dict, for ``world_size`` processes.

    ``machine_checks=False`` skips the rules about this machine (installed DeepEP, CUDA), to check a GPU job's
    config from another machine.
    """
    trainer = config.get("trainer") or {}
    cfg = _strategy_config(trainer.get("strategy", "auto"))
    if cfg is None:
        return [Problem("strategy", "`check`: trainer.strategy is not `MoEOverlapStrategy` (or `moe_overlap`).")]
    problems = check_config(cfg)
    problems += check_world(cfg, _world_size(trainer, world_size))
    if machine_checks:
        accelerator = trainer.get("accelerator", "auto")
        problems += check_machine(cfg, "cuda" if accelerator in ("gpu", "cuda") else "cpu")
    automatic = True
    model_spec = config.get("model")
    if isinstance(model_spec, dict) and "class_path" in model_spec:
        from lightning_moe_overlap.wrap import ExpertParallelModel

        with torch.device("meta"):
            model = _instantiate(model_spec)
        problems += check_model(cfg, ExpertParallelModel(model).experts_per_block())
        automatic = model.automatic_optimization
    accumulate = int(trainer.get("accumulate_grad_batches", 1))
    return problems + check_trainer(cfg, accumulate_grad_batches=accumulate, automatic_optimization=automatic)


def check_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="lightning-moe-overlap check", description=__doc__.split("\n\n")[-1])
    parser.add_argument("--config", required=True, action="append", help="YAML config file(s), merged in order")
    parser.add_argument("--world-size", type=int, default=None, help="processes (default: devices x num_nodes)")
    parser.add_argument(
        "--no-machine-checks", action="store_true", help="skip the rules about this machine (DeepEP, CUDA installed)"
    )
    args = parser.parse_args(argv)
    config: dict[str, Any] = {}
    for path in args.config:
        _merge(config, _load(path))
    problems = collect_problems(config, args.world_size, machine_checks=not args.no_machine_checks)
    errors = [p for p in problems if p.is_error]
    for p in problems:
        print(p)
    print(f"{len(errors)} error(s), {len(problems) - len(errors)} warning(s)")
    return 1 if errors else 0


def _merge(into: dict[str, Any], other: dict[str, Any]) -> None:
    for key, value in other.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("check", "validate-config"):
        raise SystemExit(check_main(argv[1:]))
    argv, trainer_defaults = pop_trace_args(argv)
    run_cli(argv, trainer_defaults)


__all__ = ["MoEOverlapStrategy", "collect_problems", "main", "run_cli"]
