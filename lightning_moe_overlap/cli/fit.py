"""``lightning-moe-overlap fit`` (and ``validate`` / ``test`` / ``predict``): LightningCLI with the strategy registered.

``--trace_step N`` adds an :class:`~lightning_moe_overlap.callbacks.OverlapTimeline` for global step ``N``: a Chrome
trace and a PNG of that step on every rank, written to ``--trace_dir`` (default ``<default_root_dir>/timeline``).
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Sequence
from typing import Any, Optional

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from typing_extensions import override

import lightning_moe_overlap  # noqa: F401  (registers the strategy names)
from lightning_moe_overlap.cli.components import raise_missing_extras

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
