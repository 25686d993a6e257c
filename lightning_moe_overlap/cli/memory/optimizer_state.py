"""How many tensors of a parameter's shape an optimizer keeps per parameter, read from the optimizer's class and
its hyper-parameters (torch's own optimizers), plus its per-parameter scalars (Adam's ``step``).

An optimizer not listed here is ``unknown``: its state is counted as zero and the table says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OptimizerState:
    """What an optimizer keeps per parameter.

    Attributes:
        name: the optimizer's class name.
        states: tensors of the parameter's shape and dtype per parameter (AdamW: ``exp_avg``, ``exp_avg_sq``).
        scalar_bytes: bytes of per-parameter scalar tensors (Adam's float32 ``step``: 4).
        known: False for an optimizer this module does not know (``states`` is then 0).
    """

    name: str
    states: int
    scalar_bytes: int = 0
    known: bool = True


def optimizer_state(name: str, hparams: Mapping[str, Any]) -> OptimizerState:
    """The state of torch's optimizer ``name`` (class name, e.g. ``"AdamW"``) with ``hparams`` (its ``defaults``,
    or the config's ``init_args``): Adam / AdamW 2 (3 with ``amsgrad``), SGD 1 with ``momentum`` else 0,
    RMSprop 1 (+1 ``momentum``, +1 ``centered``), Adagrad 1, Adamax / NAdam / RAdam 2; any other ``unknown``."""
    step = 4  # a float32 scalar `step` tensor per parameter
    if name in ("Adam", "AdamW"):
        return OptimizerState(name, 3 if hparams.get("amsgrad") else 2, step)
    if name == "SGD":
        return OptimizerState(name, 1 if float(hparams.get("momentum") or 0.0) > 0 else 0)
    if name == "RMSprop":
        extra = int(float(hparams.get("momentum") or 0.0) > 0) + int(bool(hparams.get("centered")))
        return OptimizerState(name, 1 + extra, step)
    if name == "Adagrad":
        return OptimizerState(name, 1, step)
    if name in ("Adamax", "RAdam"):
        return OptimizerState(name, 2, step)
    if name == "NAdam":
        return OptimizerState(name, 2, step + 4)  # `mu_product` too
    return OptimizerState(name, 0, 0, known=False)
