"""Random streams per context on a rank whose device is not device 0, with CUDA's per-thread current device emulated.

CUDA keeps one generator per device and a *thread-local* current device. The engine's lanes are new threads
(current device 0) that make the step's device current only while a task runs. A context that finishes hands the
baton over after its task returned, i.e. with device 0 current again; a snapshot that read the thread's device
then saved device 0's generator and lost the step device's. It matters when the backward hands over more often
than the forward (recompute regions with comm points): the forward finishes first, holding the baton, and the
next micro-batch's forward draws the same masks again.

:class:`FakeDevices` is the emulation: two devices, a generator each, a thread-local current device. It is
passed to the engine as its ``generators`` (the seam of ``overlap/rng_snapshot.py``), the context factory makes device 1
current around each task (as ``StreamState.applied`` does on CUDA), and dropout draws from the current device's
generator.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import combinations

import pytest
import torch

from lightning_moe_overlap.overlap import CommRuntime, OverlapEngine, Task
from lightning_moe_overlap.overlap.rng_snapshot import RngSource

STEP_DEVICE = 1


class FakeDevices:
    """Per-device generators and a per-thread current device (default 0), like the CUDA runtime."""

    def __init__(self, count: int = 2) -> None:
        self.gens = [torch.Generator().manual_seed(100 + d) for d in range(count)]
        self._local = threading.local()

    def is_initialized(self) -> bool:
        return True

    def current_device(self) -> int:
        return getattr(self._local, "device", 0)

    def get_rng_state(self, device: int) -> torch.Tensor:
        return self.gens[device].get_state()

    def set_rng_state(self, new_state: torch.Tensor, device: int) -> None:
        self.gens[device].set_state(new_state)

    @contextmanager
    def device(self, index: int) -> Iterator[None]:
        previous, self._local.device = self.current_device(), index
        try:
            yield
        finally:
            self._local.device = previous

    def generator(self) -> torch.Generator:
        """The current device's default generator (what ``dropout`` on a CUDA tensor draws from)."""
        return self.gens[self.current_device()]


class Point(torch.autograd.Function):
    """A comm point that hands over once in forward and ``backward_handoffs`` times in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, runtime: CommRuntime, backward_handoffs: int) -> torch.Tensor:  # noqa: ANN001
        ctx.runtime, ctx.count = runtime, backward_handoffs
        runtime.handoff()
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: ANN001
        for _ in range(ctx.count):
            ctx.runtime.handoff()
        return grad.clone(), None, None


def run(overlap: bool, backward_handoffs: int) -> dict[str, object]:
    devices, runtime = FakeDevices(), CommRuntime()
    weight = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 16))
    data = [torch.randn(16, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    masks: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(data))}

    def dropout(i: int, x: torch.Tensor) -> torch.Tensor:
        keep = torch.rand(x.shape, generator=devices.generator()) > 0.5
        masks[i].append(keep)
        return x * keep / 0.5

    def forward(i: int) -> torch.Tensor:
        h = dropout(i, data[i] * weight)
        h = Point.apply(h, runtime, backward_handoffs)
        return dropout(i, h.tanh()).square().sum()  # drawn after the forward's last hand-over

    def on_step_device(task: Task) -> Iterator[None]:
        return devices.device(STEP_DEVICE)

    engine = OverlapEngine(runtime, overlap=overlap, context_factory=on_step_device, generators=devices)
    with devices.device(STEP_DEVICE):
        engine.run(forward, lambda i, loss: loss.backward(), len(data))
    return {
        "masks": masks,
        "grad": weight.grad,
        "device_states": [devices.get_rng_state(d) for d in (0, 1)],
    }


@pytest.mark.parametrize("backward_handoffs", [1, 3], ids=["balanced", "backward-hands-over-more"])
def test_masks_distinct_per_microbatch_and_equal_to_sequential(backward_handoffs: int) -> None:
    sequential = run(overlap=False, backward_handoffs=backward_handoffs)
    overlapped = run(overlap=True, backward_handoffs=backward_handoffs)
    for i, drawn in overlapped["masks"].items():
        assert len(drawn) == 2
        for got, want in zip(drawn, sequential["masks"][i], strict=True):
            assert torch.equal(got, want), f"micro-batch {i} drew other masks than in the sequential schedule"
    flat = [m for drawn in overlapped["masks"].values() for m in drawn]
    for a, b in combinations(range(len(flat)), 2):
        assert not torch.equal(flat[a], flat[b]), f"draws {a} and {b} reused the same random offsets"
    assert torch.equal(overlapped["grad"], sequential["grad"])
    for got, want in zip(overlapped["device_states"], sequential["device_states"], strict=True):
        assert torch.equal(got, want)
    assert torch.equal(overlapped["device_states"][0], FakeDevices().get_rng_state(0))  # device 0 never drawn


def test_source_is_fixed_in_the_creating_thread_not_read_at_capture() -> None:
    devices = FakeDevices()
    with devices.device(STEP_DEVICE):
        source = RngSource.of_current_thread(devices)
    before = devices.get_rng_state(STEP_DEVICE)
    torch.rand(3, generator=devices.gens[STEP_DEVICE])
    state = source.capture()  # this thread's current device is 0 again
    assert state.device == STEP_DEVICE and not torch.equal(state.device_state, before)
    devices.set_rng_state(before, STEP_DEVICE)
    state.restore()
    assert torch.equal(devices.get_rng_state(STEP_DEVICE), state.device_state)


def test_without_an_initialised_device_only_the_cpu_generator_is_kept() -> None:
    class Uninitialised(FakeDevices):
        def is_initialized(self) -> bool:
            return False

    state = RngSource.of_current_thread(Uninitialised()).capture()
    assert state.device is None and state.device_state is None
