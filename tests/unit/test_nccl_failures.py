"""NCCL failure handling without NCCL: the error-handling variable's default and the order of the timeouts."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap import strategy as strategy_module
from lightning_moe_overlap.overlap import CommRuntime, OverlapEngine
from lightning_moe_overlap.overlap.failures import (
    NCCL_ERROR_HANDLING_VARS,
    default_nccl_error_handling,
    safety_nets,
)


def test_error_handling_defaults_to_teardown_when_unset() -> None:
    environ: dict[str, str] = {}
    assert default_nccl_error_handling(environ) is True
    assert environ == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}


@pytest.mark.parametrize("name", NCCL_ERROR_HANDLING_VARS)
def test_error_handling_set_by_the_user_is_kept(name: str) -> None:
    environ = {name: "0"}
    assert default_nccl_error_handling(environ) is False
    assert environ == {name: "0"}


@pytest.mark.parametrize("pg_timeout_s", [1.0, 600.0, 1800.0])
def test_nccl_safety_nets_never_fire_after_the_watchdog(pg_timeout_s: float) -> None:
    nets = safety_nets(pg_timeout_s, "nccl")
    assert 0 < nets.wait_s <= pg_timeout_s and 0 < nets.stall_s <= pg_timeout_s


@pytest.mark.parametrize("pg_timeout_s", [1.0, 1800.0])
def test_gloo_safety_nets_come_after_gloos_own_timeout(pg_timeout_s: float) -> None:
    nets = safety_nets(pg_timeout_s, "gloo")
    assert pg_timeout_s < nets.wait_s < nets.stall_s


def test_safety_nets_reject_a_non_positive_timeout() -> None:
    with pytest.raises(ValueError, match=r"pg_timeout_s=0.*must be > 0"):
        safety_nets(0, "nccl")


def test_engine_takes_the_stall_timeout_and_rejects_a_non_positive_one() -> None:
    assert OverlapEngine(CommRuntime(), timeout_s=10, stall_timeout_s=10).stall_timeout_s == 10
    assert OverlapEngine(CommRuntime(), timeout_s=10).stall_timeout_s == 20
    with pytest.raises(ValueError, match=r"stall_timeout_s=0.*must be > 0"):
        OverlapEngine(CommRuntime(), stall_timeout_s=0)


@pytest.mark.parametrize("backend,expected", [("nccl", "3"), ("gloo", None)])
def test_strategy_sets_the_variable_before_the_process_group_starts(
    monkeypatch: pytest.MonkeyPatch, backend: str, expected: str | None
) -> None:
    for name in NCCL_ERROR_HANDLING_VARS:
        monkeypatch.setenv(name, "x")  # recorded, so the test's changes are undone
        monkeypatch.delenv(name)
    seen: dict[str, Any] = {}

    def init_dist_connection(env: Any, backend_name: str, **kwargs: Any) -> None:
        seen["backend"], seen["value"] = backend_name, os.environ.get(NCCL_ERROR_HANDLING_VARS[0])

    monkeypatch.setattr(strategy_module.pl_compat, "init_dist_connection", init_dist_connection)
    monkeypatch.setattr(strategy_module, "destroy_process_groups_at_exit", lambda: None)
    strategy = MoEOverlapStrategy(
        process_group_backend=backend,
        num_microbatches=2,
        parallel_devices=[torch.device("cpu")],
        cluster_environment=LightningEnvironment(),
    )
    strategy._setup_distributed()
    assert seen == {"backend": backend, "value": expected}
