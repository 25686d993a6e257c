"""The engine in one process: thread-local state, context factory, delayed wgrad, random streams under recompute,
cross-rank failure reports on an in-process store."""

from __future__ import annotations

import copy
import threading
import time
from contextlib import nullcontext
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_moe_overlap.overlap import CommRuntime, OverlapEngine, PeerFailure, Role, Task, run_schedule
from lightning_moe_overlap.overlap.failures import FailureBoard, FailureWatch
from lightning_moe_overlap.overlap.streams import device_max_connections_warning
from lightning_moe_overlap.overlap.thread_state import ThreadState


class CommPoint(torch.autograd.Function):
    """A fake comm point: identity with a hand-over in forward and in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, runtime: CommRuntime) -> torch.Tensor:  # noqa: ANN001
        ctx.runtime = runtime
        runtime.handoff()
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        ctx.runtime.handoff()
        return grad.clone(), None


# -- thread-local state -------------------------------------------------------------------------------------------
def test_grad_mode_off_in_caller_is_honoured_in_both_contexts() -> None:
    seen: list[tuple[str, bool]] = []
    forward = lambda i: seen.append((threading.current_thread().name, torch.is_grad_enabled()))  # noqa: E731
    backward = lambda i, out: seen.append((threading.current_thread().name, torch.is_grad_enabled()))  # noqa: E731
    with torch.no_grad():
        run_schedule(forward, backward, 3, CommRuntime(), overlap=True)
    assert {name for name, _ in seen} == {"moe-overlap-forward", "moe-overlap-backward"}
    assert not any(enabled for _, enabled in seen)


def test_cpu_bf16_autocast_propagated() -> None:
    runtime = CommRuntime()
    layer = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    backward_autocast: list[bool] = []

    def forward(i: int) -> torch.Tensor:
        return CommPoint.apply(layer(x), runtime)

    def backward(i: int, out: torch.Tensor) -> None:
        backward_autocast.append(torch.is_autocast_enabled("cpu"))
        out.float().sum().backward()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = run_schedule(forward, backward, 2, runtime, overlap=True)
    assert [out.dtype for out in outputs] == [torch.bfloat16, torch.bfloat16]
    assert backward_autocast == [True, True]
    assert layer.weight.grad is not None and layer.weight.grad.dtype == torch.float32


def test_inference_mode_captured_and_applied_in_another_thread() -> None:
    with torch.inference_mode():
        state = ThreadState.capture()
    seen: list[bool] = []

    def probe() -> None:
        with state.applied():
            seen.append(torch.is_inference_mode_enabled())

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    assert seen == [True]


def test_context_factory_hooks_active_in_forward_context_while_it_holds_the_baton() -> None:
    runtime = CommRuntime()
    w = torch.randn(4, requires_grad=True)
    x = torch.randn(3, 4)
    events: list[str] = []
    packed: list[str] = []

    def factory(task: Task) -> object:
        events.append(f"enter {task.name} on {threading.current_thread().name}")
        if task.role is Role.FORWARD:
            return torch.autograd.graph.saved_tensors_hooks(lambda t: (packed.append(task.name), t)[1], lambda t: t)
        return nullcontext()

    def forward(i: int) -> torch.Tensor:
        events.append(f"F{i}")
        return CommPoint.apply((x * w).sin(), runtime).sum()

    def backward(i: int, loss: torch.Tensor) -> None:
        events.append(f"B{i}")
        loss.backward()

    run_schedule(forward, backward, 2, runtime, overlap=True, context_factory=factory)
    assert sorted(set(packed)) == ["F0", "F1"]
    assert events == [
        "enter F0 on moe-overlap-forward", "F0",
        "enter B0 on moe-overlap-backward", "B0",
        "enter F1 on moe-overlap-forward", "F1",  # entered only once F1 holds the baton (B0 starts the pair)
        "enter B1 on moe-overlap-backward", "B1",
    ]
    expected = torch.autograd.grad((2 * (x * w).sin().sum()), w)[0]
    torch.testing.assert_close(w.grad, expected)


@pytest.mark.parametrize("overlap", [True, False])
def test_one_microbatch_runs_in_the_calling_thread_with_the_same_step_machinery(overlap: bool) -> None:
    """M=1 has nothing to pair: F0 and B0 run in the caller's thread, no lane is started, and a task still gets the
    context factory, its delayed weight gradients flushed after its backward, and its original exception."""
    runtime = CommRuntime(delay_wgrad=True)
    w = torch.randn(4, requires_grad=True)
    x = torch.randn(3, 4)
    events: list[str] = []
    caller = threading.current_thread().name
    threads_before = threading.active_count()

    def factory(task: Task) -> object:
        events.append(f"enter {task.name} on {threading.current_thread().name}")
        return nullcontext()

    def forward(i: int) -> torch.Tensor:
        events.append(f"lanes {threading.active_count() - threads_before}")
        return CommPoint.apply((x * w).sin(), runtime).sum()

    def backward(i: int, loss: torch.Tensor) -> None:
        loss.backward()
        assert runtime.defer_wgrad(lambda: events.append("wgrad"))  # left for the engine's flush

    engine = OverlapEngine(runtime, overlap=overlap, context_factory=factory)
    (loss,) = engine.run(forward, backward, 1)
    assert events == [f"enter F0 on {caller}", "lanes 0", f"enter B0 on {caller}", "wgrad"]
    torch.testing.assert_close(w.grad, torch.autograd.grad((x * w).sin().sum(), w)[0])
    assert runtime.pending_wgrad == 0

    boom = ValueError("boom")

    def failing(i: int) -> None:
        raise boom

    with pytest.raises(ValueError) as raised:
        engine.run(failing, backward, 1)
    assert raised.value is boom


# -- delayed weight gradients ----------------------------------------------------------------------------------
def test_delayed_wgrad_flushed_in_the_backward_context_in_microbatch_order_exactly_once() -> None:
    runtime = CommRuntime(delay_wgrad=True)
    weight = torch.zeros(1)
    events: list[str] = []

    def accumulate(name: str, value: float) -> None:
        events.append(f"{name} on {threading.current_thread().name}")
        weight.add_(value)

    def forward(i: int) -> int:
        runtime.handoff()
        return i

    def backward(i: int, out: int) -> None:
        events.append(f"B{i}")
        assert runtime.defer_wgrad(partial(accumulate, f"w{i}.a", 10.0 ** (2 * i)))
        runtime.handoff()  # runs w{i}.a first, in this context, while "its" all-to-all is in flight
        assert runtime.defer_wgrad(partial(accumulate, f"w{i}.b", 10.0 ** (2 * i + 1)))
        # w{i}.b is left for the engine's flush at the end of this backward

    run_schedule(forward, backward, 3, runtime, overlap=True)
    lane = "on moe-overlap-backward"
    assert events == [
        "B0", f"w0.a {lane}", f"w0.b {lane}",
        "B1", f"w1.a {lane}", f"w1.b {lane}",
        "B2", f"w2.a {lane}", f"w2.b {lane}",
    ]
    assert weight.item() == 111111.0
    assert runtime.pending_wgrad == 0


# -- random streams under recompute --------------------------------------------------------------------------------
class DropoutBlock(nn.Module):
    """Linear -> dropout -> comm point -> linear -> dropout: random draws on both sides of a hand-over."""

    def __init__(self, runtime: CommRuntime) -> None:
        super().__init__()
        self.runtime = runtime
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = CommPoint.apply(self.drop(self.first(x)), self.runtime)
        return self.drop(self.second(h)).tanh()


def run_dropout_model(model: nn.ModuleList, recompute: str | None, overlap: bool) -> list[torch.Tensor]:
    runtime = model[0].runtime
    torch.manual_seed(1234)
    data = [torch.randn(5, 8) for _ in range(4)]

    def forward(i: int) -> torch.Tensor:
        h = model[0](data[i])  # dropout outside any checkpoint, in the forward context
        if recompute is None:
            h = model[1](h)
        else:  # recompute replays these masks inside the backward, across a hand-over
            h = checkpoint(model[1], h, use_reentrant=recompute == "reentrant")
        return CommPoint.apply(h, runtime).square().mean()

    run_schedule(forward, lambda i, loss: loss.backward(), len(data), runtime, overlap=overlap)
    return [p.grad for p in model.parameters()] + [torch.get_rng_state()]


@pytest.mark.parametrize("recompute", [None, "non-reentrant", "reentrant"])
def test_dropout_and_recompute_bitwise_equal_to_sequential(recompute: str | None) -> None:
    runtime = CommRuntime()
    torch.manual_seed(0)
    reference = nn.ModuleList([DropoutBlock(runtime), DropoutBlock(runtime)])
    sequential = run_dropout_model(copy.deepcopy(reference), recompute, overlap=False)
    overlapped = run_dropout_model(copy.deepcopy(reference), recompute, overlap=True)
    for a, b in zip(sequential, overlapped, strict=True):
        assert torch.equal(a, b)


# -- cross-rank failure reports (in-process store) --------------------------------------------------------------
def boards(world_size: int = 2, ack_timeout_s: float = 0.2) -> list[FailureBoard]:
    store = dist.HashStore()
    return [
        FailureBoard(store, rank, world_size, "run", poll_s=0.01, ack_timeout_s=ack_timeout_s)
        for rank in range(world_size)
    ]


def test_first_failure_is_posted_and_named_by_the_others() -> None:
    rank0, rank1 = boards()
    watch0, watch1 = FailureWatch(rank0, 1), FailureWatch(rank1, 1)
    time.sleep(0.02)
    assert watch0.poll() is None
    boom = ValueError("boom")
    assert watch1.explain(boom) is boom  # failed first: its original exception, after posting
    time.sleep(0.02)
    assert watch0.poll() == "rank 1: ValueError: boom"
    local = RuntimeError("Connection closed by peer")
    failure = watch0.explain(local)
    assert isinstance(failure, PeerFailure) and failure.__cause__ is local
    assert "stopped on rank 0 because another rank failed first: rank 1: ValueError: boom" in str(failure)
    assert rank0.store.add("run/1/acks", 0) == 1  # acknowledged once
    assert FailureWatch(rank0, 2).poll() is None  # reports are per step


def test_failed_rank_stops_waiting_once_acknowledged() -> None:
    rank0, rank1 = boards(ack_timeout_s=30.0)
    rank0.store.add("run/5/acks", 1)
    start = time.monotonic()
    FailureWatch(rank1, 5).explain(ValueError("x"))
    assert time.monotonic() - start < 5


def test_without_a_process_group_errors_pass_through() -> None:
    engine = OverlapEngine(CommRuntime())

    def forward(i: int) -> None:
        raise OSError("disk")

    with pytest.raises(OSError, match="disk"):
        engine.run(forward, lambda i, out: None, 2)


# -- arguments and warnings ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["timeout_s", "failure_poll_s"])
def test_engine_rejects_non_positive_timeouts(name: str) -> None:
    with pytest.raises(ValueError, match=rf"`OverlapEngine\({name}=0\)`: must be > 0"):
        OverlapEngine(CommRuntime(), **{name: 0})


def test_device_max_connections_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    assert device_max_connections_warning() is None  # CUDA not in use: nothing to serialise
    monkeypatch.setattr("lightning_moe_overlap.overlap.streams.cuda_in_use", lambda: True)
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in device_max_connections_warning()
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    assert device_max_connections_warning() is None


def test_thread_state_carries_the_intra_op_thread_count_into_a_context_thread():
    """OpenMP keeps the thread count per thread: a context thread must use the caller's, or its GEMMs may be blocked
    differently and differ in the last bit from the same GEMMs on the caller's thread."""
    from lightning_moe_overlap.overlap.thread_state import ThreadState

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        state = ThreadState.capture()
        seen = {}

        def run() -> None:
            torch.set_num_threads(2)  # a thread whose own count differs from the caller's
            with state.applied():
                seen["inside"] = torch.get_num_threads()

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        assert state.intra_op_threads == 1 and seen["inside"] == 1
    finally:
        torch.set_num_threads(before)


def test_a_peer_message_ending_in_a_period_is_not_followed_by_another() -> None:
    rank0, rank1 = boards()
    watch0, watch1 = FailureWatch(rank0, 1), FailureWatch(rank1, 1)
    watch1.explain(ValueError("Fix: choose the length so."))
    time.sleep(0.02)
    text = str(watch0.explain(RuntimeError("Connection closed by peer")))
    assert "choose the length so. Its traceback is in that rank's output" in text and ".." not in text, text
