"""A loopback all-to-all of known duration: simulated expert parallelism in one process.

NCCL refuses two ranks on one GPU, so the overlap cannot be shown with real EP on a single device. A
:class:`Loopback` is a communicator (``communicator.py``) that stands for the other ranks of a one-process ep
group: given to the runtime (``CommRuntime(communicator=Loopback(comm_s))``), it issues every all-to-all of a
world-size-1 (``ep=1``) model as a :class:`Waitable` that copies its input to its output after ``comm_s`` seconds,
handed over and waited on exactly like ``torch.distributed``'s ``Work``:

- CUDA (:class:`CudaLoopbackWork`): on a side stream that first waits for the compute stream, a
  ``torch.cuda._sleep`` of calibrated cycles, then the copy, then an event; ``wait()`` makes the caller's current
  stream wait for the event and returns without blocking the host: the semantics of NCCL's ``Work``.
- CPU (:class:`ThreadLoopbackWork`): a thread sleeps ``comm_s`` then copies; ``wait()`` joins it (gloo's
  blocking ``wait``).

The data really moves through the copy, so a missing wait (or a stream race) changes the numbers and the bitwise
comparison with the sequential schedule catches it.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_moe_overlap._compat import torch as torch_compat
from lightning_moe_overlap.overlap.communicator import TorchCommunicator, group_size


class ThreadLoopbackWork:
    """``out.copy_(inp)`` on a thread after ``comm_s`` seconds; ``wait()`` blocks until it is done."""

    def __init__(self, out: Tensor, inp: Tensor, comm_s: float) -> None:
        self._thread = threading.Thread(target=self._run, args=(out, inp, comm_s), name="loopback", daemon=True)
        self._thread.start()

    @staticmethod
    def _run(out: Tensor, inp: Tensor, comm_s: float) -> None:
        time.sleep(comm_s)
        out.copy_(inp)

    def wait(self) -> bool:
        self._thread.join()
        return True


class CudaLoopbackWork:
    """``out.copy_(inp)`` on ``stream`` after ``cycles`` of ``torch.cuda._sleep``; ``wait()`` is stream-ordered."""

    def __init__(self, out: Tensor, inp: Tensor, cycles: int, stream: torch.cuda.Stream) -> None:
        self._device = inp.device
        stream.wait_stream(torch.cuda.current_stream(self._device))  # the input is ready, as NCCL does at issue
        with torch.cuda.stream(stream):
            torch_compat.cuda_sleep(cycles)
            out.copy_(inp)
            self._done = torch.cuda.Event()
            self._done.record(stream)
        inp.record_stream(stream)  # the caching allocator must not hand these out before the copy ran
        out.record_stream(stream)

    def wait(self) -> bool:
        torch.cuda.current_stream(self._device).wait_event(self._done)
        return True


class Loopback(TorchCommunicator):
    """A communicator whose all-to-alls are loopbacks of ``comm_s`` seconds (``ep=1`` models only); the other
    collectives are ``torch.distributed``'s (with one rank, none is issued).

    Args:
        comm_s: the duration of every simulated collective.
        device: where the tensors live; CUDA uses a side stream and a calibrated sleep kernel.
    """

    def __init__(self, comm_s: float, device: torch.device | str = "cpu") -> None:
        if not comm_s >= 0:
            raise ValueError(f"`Loopback(comm_s={comm_s})`: the simulated communication time must be >= 0 seconds.")
        self.comm_s = float(comm_s)
        self.device = torch.device(device)
        self._stream: torch.cuda.Stream | None = None
        self._cycles = 0
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(self.device, priority=-1)  # like the ep group's high-priority stream
            self._cycles = round(self.comm_s * cycles_per_second(self.device))

    def __call__(self, out: Tensor, inp: Tensor) -> ThreadLoopbackWork | CudaLoopbackWork:
        """Issue ``out <- inp`` (same shape) and return its work."""
        if self._stream is not None:
            return CudaLoopbackWork(out, inp, self._cycles, self._stream)
        return ThreadLoopbackWork(out, inp, self.comm_s)

    # -- the communicator ------------------------------------------------------------------------------------------
    def exchanges(self, group: ProcessGroup | None) -> bool:
        """Always: the loopback stands for the ranks the rows would go to."""
        return True

    def all_to_all(
        self, out_MD: Tensor, x_ND: Tensor, output_splits: Sequence[int], input_splits: Sequence[int],
        group: ProcessGroup | None,
    ) -> ThreadLoopbackWork | CudaLoopbackWork:
        size = group_size(group)
        if size > 1:
            raise ValueError(
                f"`Loopback`: an all-to-all over an ep group of {size} ranks; a loopback stands for the other ranks "
                "of a one-process group (ep=1) and cannot exchange with real ones. Build the model with ep=1 for "
                "simulated expert parallelism, or leave the runtime's communicator at None for real ranks."
            )
        return self(out_MD, x_ND)

    def remote_rows(self, input_splits: Sequence[int], group: ProcessGroup | None) -> int:
        """Every row: they all stand for rows sent to other ranks."""
        return sum(input_splits)


def cycles_per_second(device: torch.device, probe_cycles: int = 10_000_000, repeats: int = 5) -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per second on ``device`` (median of ``repeats`` timings)."""
    rates = []
    with torch.cuda.device(device):
        torch_compat.cuda_sleep(probe_cycles)  # warm-up
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch_compat.cuda_sleep(probe_cycles)
            end.record()
            end.synchronize()  # NOTE: D2H sync (calibration, before training)
            rates.append(probe_cycles / (start.elapsed_time(end) / 1e3))
    return statistics.median(rates)
