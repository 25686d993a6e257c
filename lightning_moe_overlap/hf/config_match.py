"""The keys an export writes against the model its ``config.json`` builds: a Hub folder must load with
``from_pretrained`` and no missing, unexpected or misshapen key, so an export whose tensors are not that model's (a
config from another size, a prefix that keeps too little or too much of the names) is refused before it writes.

The oracle is transformers itself: the ``AutoModelForCausalLM`` its ``from_config`` builds on the meta device (no
memory), its state dict cut into file keys by the same key family as the export.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_moe_overlap.hf.file_layout import file_entries
from lightning_moe_overlap.hf.keys import HFFamily


def config_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]] | None:
    """``{name: global shape}`` of the state dict of the causal LM transformers builds from ``config`` (a
    ``config.json`` dict); None where transformers is missing or does not know the model type (nothing to check
    against: ``from_pretrained`` could not load the folder either)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:  # pragma: no cover - depends on the environment
        return None
    settings = {k: v for k, v in config.items() if k != "model_type"}
    try:
        built = AutoConfig.for_model(str(config.get("model_type")), **settings)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(built)
    except (ValueError, KeyError):
        return None
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_keys_fit_config(
    written: Mapping[str, tuple[int, ...]],
    config: Mapping[str, Any],
    family: HFFamily,
    *,
    tied: bool,
    owner: str,
) -> None:
    """Refuse ``written`` (file key -> shape) unless it is exactly what the model of ``config`` loads.

    Raises:
        ValueError: missing, unexpected or misshapen keys, each listed (the first five) with their counts.
    """
    shapes = config_shapes(config)
    if shapes is None:
        return
    expected = {p.key: p.shape for _, p in file_entries(shapes, family, tied=tied, owner=owner)}
    missing = sorted(set(expected) - set(written))
    unexpected = sorted(set(written) - set(expected))
    misshapen = sorted(k for k in set(expected) & set(written) if tuple(expected[k]) != tuple(written[k]))
    if not (missing or unexpected or misshapen):
        return
    parts = [
        f"{label} {names[:5]} ({len(names)})"
        for label, names in (("missing", missing), ("unexpected", unexpected), ("misshapen", misshapen)) if names
    ]  # fmt: skip
    size = {k: config.get(k) for k in ("model_type", "num_hidden_layers", "hidden_size") if k in config}
    raise ValueError(
        f"{owner}: the tensors are not the model of the config ({size}): {'; '.join(parts)}. Rule: the folder must "
        "load with `from_pretrained` with no missing, unexpected or misshapen key. Fix: pass the config of the model "
        "that was trained (`model.config`, or the config.json it started from with the run's overrides) and the "
        "prefix of the HF model's attribute in the names, with its dot (`model.` for `self.model`)."
    )
