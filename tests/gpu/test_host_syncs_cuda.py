"""No undocumented host sync on the CUDA dispatch path: an overlapped step under ``set_sync_debug_mode("error")``.

One process (ep=1, no group), a ``MoELayer`` (router with aux and z losses, capacity drop, expert-parallel experts
on the per-expert loop, whose grouped-GEMM offsets are not part of this check) run as two overlapped
micro-batches by the engine. With the debug mode at "error", every stream or device synchronisation and every
blocking copy raises. The documented sync points (``host_ints``: split sizes read through pinned memory after an
event) wait on an event, which the debug mode does not flag; anything else fails the test. The parameters'
gradients must equal the sequential schedule's bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from lightning_moe_overlap.moe import MoELayer, apply_expert_parallel
from lightning_moe_overlap.moe.dispatch.host import host_ints
from lightning_moe_overlap.overlap import CommRuntime, run_schedule
from lightning_moe_overlap.overlap.order import CommOrder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="Requires: CUDA (torch.cuda.set_sync_debug_mode)"),
]


def _layer(dispatcher: str, runtime: CommRuntime) -> MoELayer:
    torch.manual_seed(0)
    layer = MoELayer(64, 32, 8, 2, capacity_factor=1.5, experts_impl="loop", aux_loss_coeff=1e-2, z_loss_coeff=1e-3)
    apply_expert_parallel(layer, None, dispatcher=dispatcher, runtime=runtime, impl="loop")
    return layer.cuda()


def _step(layer: MoELayer, runtime: CommRuntime, inputs: list[torch.Tensor], overlap: bool) -> list[torch.Tensor]:
    layer.zero_grad(set_to_none=True)
    run_schedule(
        lambda i: layer(inputs[i]).square().mean(),
        lambda i, loss: loss.backward(),
        len(inputs),
        runtime,
        overlap=overlap,
    )
    return [p.grad.clone() for p in layer.parameters()]


def _overlapped_equals_sequential_without_syncs(layer: MoELayer, runtime: CommRuntime, dtype: torch.dtype) -> None:
    """A sequential step (which also warms up cuBLAS, pinned memory, events), then an overlapped one with every
    synchronisation an error; their gradients bitwise equal."""
    g = torch.Generator(device="cuda").manual_seed(1)
    inputs = [torch.randn(4, 16, 64, device="cuda", generator=g, dtype=dtype) for _ in range(2)]
    sequential = _step(layer, runtime, inputs, overlap=False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        overlapped = _step(layer, runtime, inputs, overlap=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for got, want in zip(overlapped, sequential):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_overlapped_step_has_no_undocumented_host_sync(dispatcher: str) -> None:
    runtime = CommRuntime()
    _overlapped_equals_sequential_without_syncs(_layer(dispatcher, runtime), runtime, torch.float32)


def test_the_debug_mode_catches_what_the_dispatchers_avoid() -> None:
    """The oracle can fail: the ops replaced on the hot path raise under the same mode; `host_ints` does not."""
    t = torch.tensor([0, 3, 3, 1], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for sync in (lambda: torch.bincount(t), lambda: t.tolist(), lambda: torch.tensor([1, 2], device="cuda")):
            with pytest.raises(RuntimeError, match="synchroniz"):
                sync()
        assert host_ints(t) == [0, 3, 3, 1]
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_the_static_dispatch_syncs_nothing_in_bf16() -> None:
    """``static=True`` with the experts on ``torch._grouped_mm`` (bf16 on CUDA): not even the documented read of the
    split sizes; the overlapped step's gradients are bitwise the sequential one's. In float32 the CUDA experts take the
    per-expert loop, which reads the counts once per call (docs/dispatchers.md, "Static dispatch")."""
    runtime = CommRuntime()
    order = CommOrder()  # records every read of sizes the dispatchers report
    runtime.attach(order)
    torch.manual_seed(0)
    layer = MoELayer(64, 32, 8, 2, capacity_factor=1.5, aux_loss_coeff=1e-2, z_loss_coeff=1e-3)
    apply_expert_parallel(layer, None, dispatcher="alltoall", runtime=runtime, static=True)
    _overlapped_equals_sequential_without_syncs(layer.cuda().to(torch.bfloat16), runtime, torch.bfloat16)
    assert [e for events in order.events.values() for e in events if e == "host_read"] == []
