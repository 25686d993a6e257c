"""The trainer's loggers and callbacks, built as ``fit`` builds them, so ``check`` reports what ``fit`` cannot build.

``fit`` instantiates ``trainer.logger`` and ``trainer.callbacks`` from their ``class_path`` before anything starts;
parsing alone does not. A class that needs an optional package (``TensorBoardLogger`` needs ``tensorboard``, the
``loggers`` extra) is checked first, by importing the package, and reported with the extra that installs it;
``fit`` refuses it with the same one-line message (:class:`MissingExtraError`) instead of jsonargparse's traceback.
Every other component is built once and any error it raises becomes a finding.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterator
from typing import Any

from lightning_moe_overlap._install import install_hint
from lightning_moe_overlap.callbacks.expert_balance import ExpertBalance, balance_errors
from lightning_moe_overlap.config import OverlapConfig
from lightning_moe_overlap.validation import Problem

# class names (their own or a base's) -> (modules of which one must import, the extra that installs the first)
_NEEDS: dict[str, tuple[tuple[str, ...], str]] = {
    "TensorBoardLogger": (("tensorboard", "tensorboardX"), "loggers"),
}
# modules an error may name -> the extra that installs them
_EXTRA_OF_MODULE = {"tensorboard": "loggers", "tensorboardX": "loggers", "matplotlib": "plot", "transformers": "hf"}


class MissingExtraError(ImportError):
    """A logger or callback of the config needs an optional package that is not installed."""


def component_specs(trainer: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, spec)`` of each ``class_path`` spec under ``trainer.logger`` and ``trainer.callbacks``."""
    for key in ("logger", "callbacks"):
        value = trainer.get(key)
        items = value if isinstance(value, list) else [value]
        for i, spec in enumerate(items):
            if isinstance(spec, dict) and "class_path" in spec:
                yield (f"trainer.{key}[{i}]" if isinstance(value, list) else f"trainer.{key}"), spec


def missing_extras(trainer: dict[str, Any]) -> list[Problem]:
    """A finding for each logger or callback whose optional package does not import (rule ``component-extra``)."""
    found = (_missing_extra(where, spec) for where, spec in component_specs(trainer))
    return [p for p in found if p is not None]


def component_problems(trainer: dict[str, Any]) -> list[Problem]:
    """:func:`missing_extras`, and every other logger or callback built once: what ``fit`` would fail on."""
    out = []
    for where, spec in component_specs(trainer):
        missing = _missing_extra(where, spec)
        if missing is not None:
            out.append(missing)
            continue
        try:
            build(spec)
        except ImportError as err:
            extra = _EXTRA_OF_MODULE.get((err.name or "").split(".")[0])
            if extra is None:
                out.append(_failed(where, spec["class_path"], err))
            else:
                out.append(_missing(where, spec["class_path"], (str(err.name),), extra))
        except Exception as err:  # noqa: BLE001 - the component may be the user's code: a finding, never a traceback
            out.append(_failed(where, spec["class_path"], err))
    return out


def expert_balance_problems(cfg: OverlapConfig, trainer: dict[str, Any]) -> list[Problem]:
    """The rules an ``ExpertBalance`` among ``trainer.callbacks`` needs of the strategy (rule ``expert-balance``;
    ``callbacks/expert_balance.py``), and more than one of them."""
    balancers = []
    for where, spec in component_specs(trainer):
        if spec["class_path"].rpartition(".")[2] == ExpertBalance.__name__:
            try:
                found = build(spec)
            except Exception:  # noqa: BLE001 - `component_problems` reports it
                continue
            if isinstance(found, ExpertBalance):
                balancers.append((where, found))
    out = [Problem("expert-balance", f"{where}: {err}", type(err))
           for where, balancer in balancers for err in balance_errors(cfg, balancer.redundant_experts)]  # fmt: skip
    if len(balancers) > 1:
        where = ", ".join(w for w, _ in balancers)
        out.append(Problem("expert-balance", f"{where}: {len(balancers)} `ExpertBalance` callbacks would each "
                           "re-place the same experts on their own schedule. Keep one."))  # fmt: skip
    return out


def build(value: Any) -> Any:
    """``value`` with every ``{"class_path": ..., "init_args": ...}`` in it instantiated, innermost first."""
    if isinstance(value, list):
        return [build(v) for v in value]
    if not (isinstance(value, dict) and "class_path" in value):
        return value
    module_name, _, cls_name = value["class_path"].rpartition(".")
    cls = getattr(importlib.import_module(module_name), cls_name)
    kwargs = {k: build(v) for k, v in (value.get("init_args") or {}).items()}
    return cls(**kwargs, **(value.get("dict_kwargs") or {}))


def raise_missing_extras(trainer: dict[str, Any]) -> None:
    """Raise :class:`MissingExtraError` with every missing optional package of the config's loggers and callbacks."""
    missing = missing_extras(trainer)
    if missing:
        raise MissingExtraError("\n".join(p.message for p in missing))


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails, or a module entry without a spec
        return False


def _missing_extra(where: str, spec: dict[str, Any]) -> Problem | None:
    cls = _class_or_none(spec["class_path"])
    need = next((_NEEDS[c.__name__] for c in getattr(cls, "__mro__", ()) if c.__name__ in _NEEDS), None)
    if need is None or any(_importable(m) for m in need[0]):
        return None
    return _missing(where, spec["class_path"], *need)


def _class_or_none(class_path: str) -> type | None:
    module_name, _, cls_name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name, None)
    except Exception:  # noqa: BLE001 - reported when the component is built
        return None
    return cls if isinstance(cls, type) else None


def _missing(where: str, class_path: str, modules: tuple[str, ...], extra: str) -> Problem:
    alternatives = "".join(f" (or `{m}`)" for m in modules[1:])
    return Problem(
        "component-extra",
        f"`{where}` is `{class_path}`, which needs the `{modules[0]}` package{alternatives}, not installed here; "
        "`fit` builds every logger "
        f"and callback before it starts, so it would fail here. Install the `{extra}` extra: {install_hint(extra)}"
        + ("; or use `CSVLogger` (needs nothing) or `logger: false`." if where.startswith("trainer.logger") else "."),
        ImportError,
    )


def _failed(where: str, class_path: str, err: Exception) -> Problem:
    return Problem(
        "component-build",
        f"`{where}` is `{class_path}`, and building it as `fit` does failed: {type(err).__name__}: "
        f"{str(err).rstrip('.')}. Fix its "
        "`init_args` (or the class) as the error says.",
        type(err) if isinstance(err, (ValueError, TypeError, ImportError, RuntimeError)) else RuntimeError,
    )


__all__ = ["MissingExtraError", "build", "component_problems", "component_specs", "missing_extras",
           "raise_missing_extras"]  # fmt: skip
