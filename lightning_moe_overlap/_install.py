"""How to install an optional extra, in words that work from a source checkout and from a published package."""

from __future__ import annotations


def install_hint(extra: str) -> str:
    """``pip install -e ".[extra]"`` (source checkout) or ``pip install "lightning-moe-overlap[extra]"``."""
    return f'`pip install -e ".[{extra}]"` in a source checkout, or `pip install "lightning-moe-overlap[{extra}]"`'
