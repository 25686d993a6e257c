"""Host syncs per MoE layer and micro-batch, counted on CPU: exactly the ones docs/dispatchers.md lists.

One forward + backward of a ``MoELayer`` (router with aux and z losses, capacity drop, expert-parallel experts
on the per-expert loop, each dispatcher at ep=1) runs under :class:`~tests.helpers.syncs.SyncCounter`. Every op
that would make the CPU wait for a CUDA device is counted; the DeepEP test double is not (it stands for DeepEP,
whose own wait is documented separately). The two-rank version (ep=2, with the order of syncs against the
collectives) is in ``tests/distributed/test_host_syncs.py``.
"""

from __future__ import annotations

import pytest
import torch

from lightning_moe_overlap.moe import MoELayer, apply_expert_parallel
from lightning_moe_overlap.moe.permute import chunk_permutation, count_per_expert, sort_by_expert
from lightning_moe_overlap.overlap.runtime import CommRuntime
from tests.helpers.syncs import SyncCounter
from tests.unit.test_dispatch_flex import FakeDeepEPBuffer

# The documented syncs (docs/dispatchers.md, "Host syncs per layer per micro-batch"), per dispatcher at ep=1.
DOCUMENTED = {"alltoall": {"tolist": 1}, "allgather": {"tolist": 2}, "flex": {}}


class PausedFake(FakeDeepEPBuffer):
    """The DeepEP double, with its own (torch-made) syncs not counted."""

    counter: SyncCounter | None = None

    def _paused(self, name: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        assert self.counter is not None
        with self.counter.paused():
            return getattr(super(), name)(*args, **kwargs)

    def get_dispatch_layout(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self._paused("get_dispatch_layout", *args, **kwargs)

    def dispatch(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self._paused("dispatch", *args, **kwargs)

    def combine(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self._paused("combine", *args, **kwargs)


def _layer(dispatcher: str, counter: SyncCounter) -> MoELayer:
    torch.manual_seed(0)
    layer = MoELayer(
        16, 8, 4, 2, capacity_factor=1.5, experts_impl="loop", aux_loss_coeff=1e-2, z_loss_coeff=1e-3
    )
    fake = PausedFake()
    fake.counter = counter
    knobs = {"deepep_buffer": fake} if dispatcher == "flex" else {}
    apply_expert_parallel(layer, None, dispatcher=dispatcher, runtime=CommRuntime(), impl="loop", **knobs)
    return layer


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather", "flex"])
def test_host_syncs_of_one_moe_layer_forward_and_backward(dispatcher: str) -> None:
    counter = SyncCounter()
    layer = _layer(dispatcher, counter)
    x = torch.randn(2, 5, 16, requires_grad=True)
    with counter:
        layer(x).square().sum().backward()
    assert dict(counter.counts) == DOCUMENTED[dispatcher], counter.log
    assert x.grad is not None and layer.gate.weight.grad is not None


def test_sync_counter_sees_the_ops_it_promises() -> None:
    """The oracle can fail: each sync-causing op is counted (so a reintroduced one fails the test above)."""
    t = torch.tensor([2, 0, 2, 1])
    with SyncCounter() as counter:
        torch.bincount(t)
        t.tolist()
        t.sum().item()
        bool(t.any())
        t.nonzero()
        t[t > 0]
        torch.repeat_interleave(t, t)
        t.to("cpu")
        torch.tensor([1, 2], device="cpu")
    assert set(counter.counts) == {
        "aten.bincount",
        "tolist",
        "item",
        "bool",
        "aten.nonzero",
        "aten.index(bool mask)",
        "aten.repeat_interleave",
        "to(device)",
        "torch.tensor(device=...)",
    }, counter.counts


def test_permute_helpers_are_sync_free_and_match_bincount() -> None:
    g = torch.Generator().manual_seed(0)
    indices = torch.randint(-1, 6, (9, 3), generator=g)
    with SyncCounter() as counter:
        order, counts = sort_by_expert(indices, 5)
        counts_SE = torch.tensor([[1, 0, 2], [3, 1, 0]])
        perm = chunk_permutation(counts_SE, 7)
        hist = count_per_expert(torch.tensor([0, 3, 3, 1]), 4)
    # Only the test's own `torch.tensor` literals are counted; the helpers add nothing.
    assert counter.total == 0, counter.counts
    flat = indices.reshape(-1)
    kept = (flat >= 0) & (flat < 5)
    assert torch.equal(counts, torch.bincount(flat[kept], minlength=5))
    assert torch.equal(hist, torch.bincount(torch.tensor([0, 3, 3, 1]), minlength=4))
    assert perm.tolist() == [0, 3, 4, 5, 6, 1, 2]
    num_kept = int(kept.sum())
    assert torch.equal(order[:num_kept], torch.argsort(torch.where(kept, flat, 5), stable=True)[:num_kept])
