"""The one registry mechanism behind the experts adapters and the memory callbacks' layer names."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from torch import nn

from lightning_moe_overlap.callbacks.layer_specs import LAYER_SPECS, register_layer_names
from lightning_moe_overlap.moe.adapters import ADAPTERS, register_experts_adapter, registered_adapters
from lightning_moe_overlap.registry import Registry


@dataclass(frozen=True)
class Thing:
    name: str


def _registry() -> Registry[Thing]:
    return Registry("thing", (Thing("a"), Thing("b")), ("add_thing", "drop_thing"))


def test_add_remove_and_order() -> None:
    reg = _registry()
    reg.add(Thing("c"), fix="")
    reg.add(Thing("d"), fix="")
    assert reg.builtin == (Thing("a"), Thing("b")) and reg.user == (Thing("c"), Thing("d"))
    assert reg.names() == ["a", "b", "c", "d"]
    assert reg.remove("c") == Thing("c")
    assert reg.user == (Thing("d"),)


def test_errors_name_the_function_the_value_and_the_fix() -> None:
    reg = _registry()
    with pytest.raises(ValueError, match=r"`add_thing`: a thing named 'a' is already registered.*Rename it"):
        reg.add(Thing("a"), fix="Rename it.")
    with pytest.raises(ValueError, match=r"`drop_thing`: no user thing named 'a'; registered: \[\]\. Built-in"):
        reg.remove("a")


def test_scoped_undoes_additions_and_removals() -> None:
    reg = _registry()
    reg.add(Thing("kept"), fix="")
    with reg.scoped():
        reg.add(Thing("temporary"), fix="")
        reg.remove("kept")
        assert reg.names() == ["a", "b", "temporary"]
    assert reg.names() == ["a", "b", "kept"]
    with pytest.raises(RuntimeError), reg.scoped():
        reg.add(Thing("lost"), fix="")
        raise RuntimeError("boom")
    assert reg.names() == ["a", "b", "kept"]


def test_a_registration_in_one_test_is_gone_in_the_next_part_one() -> None:
    register_experts_adapter("leak_probe", lambda m: False, lambda m: None)
    register_layer_names(nn.Linear, {"x": "y"}, name="leak_probe")
    assert registered_adapters()[0].name == "leak_probe"


def test_a_registration_in_one_test_is_gone_in_the_next_part_two() -> None:
    # Runs after part one (file order): the autouse fixture in tests/conftest.py restored both registries.
    assert "leak_probe" not in ADAPTERS.names()
    assert "leak_probe" not in LAYER_SPECS.names()
    assert ADAPTERS.user == () and LAYER_SPECS.user == ()
