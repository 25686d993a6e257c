"""The communicators of the comm points: ``torch.distributed``'s, and the benchmark's loopback standing for the
other ranks of a one-process ep group."""

from __future__ import annotations

import pytest
import torch

from lightning_moe_overlap.moe.dispatch import loopback as loopback_module
from lightning_moe_overlap.moe.dispatch.comm import all_to_all_raw, communicator_of
from lightning_moe_overlap.overlap.communicator import TORCH
from lightning_moe_overlap.moe.dispatch.loopback import Loopback
from lightning_moe_overlap.overlap.observers import CommTraffic
from lightning_moe_overlap.overlap.runtime import CommRuntime


def test_the_default_communicator_is_torch_distributed_and_moves_nothing_on_one_rank() -> None:
    assert communicator_of(None) is TORCH and communicator_of(CommRuntime()) is TORCH
    assert not TORCH.exchanges(None)
    assert TORCH.remote_rows([3, 4], None) == 4  # rank 0 keeps its own 3 rows


def test_an_injected_loopback_carries_the_rows_and_counts_them_all_as_remote() -> None:
    runtime, traffic = CommRuntime(communicator=Loopback(0.0)), CommTraffic()
    runtime.attach(traffic)
    x = torch.arange(12.0).view(6, 2)
    out = all_to_all_raw(x, [6], [6], None, runtime)
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()  # copied through the loopback, not skipped
    assert traffic.reset() == (1, 48, 48)
    plain = CommRuntime()
    assert all_to_all_raw(x, [6], [6], None, plain) is x  # one rank, torch.distributed: nothing issued


def test_a_loopback_refuses_a_group_of_real_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loopback_module, "group_size", lambda group: 2)
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"ep group of 2 ranks.*Build the model with ep=1"):
        Loopback(0.0).all_to_all(torch.empty_like(x), x, [1, 1], [1, 1], object())
