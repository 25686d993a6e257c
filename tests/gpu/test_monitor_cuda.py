"""The CUDA side of the monitor: comm points timed with CUDA events, read once."""

from __future__ import annotations

import pytest
import torch

from lightning_moe_overlap.overlap.event_timer import EventCommTimer
from lightning_moe_overlap.overlap.runtime import CommRuntime

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="Requires: CUDA (device-side event timing)")


class StreamWork:
    """A fake collective on a side stream: a long kernel, and ``wait`` makes the current stream wait for it."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.event = torch.cuda.Event()
        with torch.cuda.stream(stream):
            a = torch.randn(2048, 2048, device="cuda")
            for _ in range(20):
                a = a @ a / 2048
            self.event.record(stream)

    def wait(self) -> bool:
        torch.cuda.current_stream().wait_event(self.event)
        return True


def test_event_timer_sees_the_stall_of_the_compute_stream() -> None:
    runtime = CommRuntime()
    runtime.attach(timer := EventCommTimer())
    side = torch.cuda.Stream()
    work = StreamWork(side)
    runtime.handoff()
    runtime.wait(work)  # nothing queued on the compute stream: the whole side work is exposed
    times = timer.reset()
    assert times.waits == 1
    assert times.blocked_s > 0
    assert times.in_flight_s >= times.blocked_s
