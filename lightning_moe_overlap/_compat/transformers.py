"""Hugging Face transformers' private names, each behind one function (tests/unit/test_compat_transformers.py)."""

from __future__ import annotations

from typing import Any


def attn_implementation(config: Any) -> str | None:
    """The attention implementation a model's config names (``config._attn_implementation``; what
    ``set_attn_implementation`` sets)."""
    return getattr(config, "_attn_implementation", None)
