"""Hugging Face transformers' private names, each behind one function (tests/unit/test_compat_transformers.py)."""

from __future__ import annotations

from typing import Any


def attn_implementation(config: Any) -> str | None:
    """The attention implementation a model's config names (``config._attn_implementation``; what
    ``set_attn_implementation`` sets)."""
    return getattr(config, "_attn_implementation", None)


def from_config(model_class: type, config: Any, **kwargs: Any) -> Any:
    """A model of ``model_class`` (a ``PreTrainedModel`` subclass) built from ``config`` with HF's own init contexts
    (``model_class._from_config``: ``dtype`` as the parameters' dtype with float32 buffers kept,
    ``attn_implementation``), as the auto classes' public ``from_config`` builds the class a config maps to."""
    return model_class._from_config(config, **kwargs)
