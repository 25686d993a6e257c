"""``benchmarks/peer_torchtitan.py`` without torchtitan: the script stops with the install hint, nothing launched."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import peer_torchtitan  # noqa: E402


def test_without_torchtitan_the_script_exits_with_the_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchtitan", None)  # `import torchtitan` raises ImportError
    launched: list[object] = []
    monkeypatch.setattr(peer_torchtitan, "launch", lambda *args: launched.append(args))
    with pytest.raises(SystemExit, match=r"needs torchtitan 0\.3\.0 .*pip install 'lightning-moe-overlap\[peer\]'"):
        peer_torchtitan.main(["--rounds", "1"])
    assert not launched
