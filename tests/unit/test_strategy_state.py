"""What the strategy refuses to give before its processes and setup exist: each accessor names when it is ready."""

from __future__ import annotations

import pytest

from lightning_moe_overlap import MoEOverlapStrategy


def test_groups_and_mesh_before_they_exist_are_refused_with_when_they_are_ready() -> None:
    strategy = MoEOverlapStrategy(ep=2)
    with pytest.raises(RuntimeError, match=r"`MoEOverlapStrategy.parallel_groups` is only available after the "
                                           r"processes have initialised \(from `configure_model` on\)"):
        strategy.parallel_groups
    with pytest.raises(RuntimeError, match=r"`MoEOverlapStrategy.parallel_mesh` is only available from the "
                                           r"strategy's `setup` on \(after `configure_model`\)"):
        strategy.parallel_mesh
