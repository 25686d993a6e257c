"""The third-party noise filters are narrow: the named warning from the named module only."""

from __future__ import annotations

import warnings

from lightning_moe_overlap._noise import quiet_third_party_noise

LEAFSPEC = "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and treespec.is_leaf()`"


def _warn_from(module: str, message: str, category: type[Warning]) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_third_party_noise()
        warnings.warn_explicit(message, category, filename=f"{module}.py", lineno=1, module=module)
    return caught


def test_lightning_pytree_leafspec_warning_is_filtered():
    assert _warn_from("lightning.pytorch.utilities._pytree", LEAFSPEC, FutureWarning) == []


def test_other_warnings_pass():
    assert len(_warn_from("my_project.model", LEAFSPEC, FutureWarning)) == 1  # same text, someone else's code
    assert len(_warn_from("lightning.pytorch.utilities._pytree", "something else", FutureWarning)) == 1
    assert len(_warn_from("lightning.pytorch.utilities._pytree", LEAFSPEC, UserWarning)) == 1
