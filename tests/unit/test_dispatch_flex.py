"""The flex (DeepEP) dispatcher's logic against a test double of ``deep_ep.Buffer`` built from torch ops.

``FakeDeepEPBuffer`` implements the methods the dispatcher calls with DeepEP's semantics: tokens are sent once
per destination rank with their top-k indices translated to that rank's local experts (``-1`` elsewhere),
``combine`` sums the returned rows (and top-k weights) into the source tokens, and ``dispatch(handle=...)``
replays a cached layout. Over a gloo group it communicates synchronously (the distributed tests use it with
2 and 4 ranks); without a group it is a single rank. It records every call so the call sequence can be checked.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_moe_overlap.moe import Experts, apply_expert_parallel
from lightning_moe_overlap.moe.dispatch import (
    AllToAllDispatcher,
    FlexDispatcher,
    build_dispatcher,
    require_flex_backend,
)
from lightning_moe_overlap.moe.dispatch.deepep_buffers import index_dtype
from lightning_moe_overlap.moe.grouped import grouped_mlp
from lightning_moe_overlap.overlap.observers import CommTimer
from lightning_moe_overlap.overlap.runtime import CommRuntime


class FakeEvent:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def current_stream_wait(self) -> None:
        self.log.append(f"wait:{self.name}")


@dataclass(frozen=True)
class FakeLayoutHandle:
    send_token_ids: Tensor  # source token of every row sent, grouped by destination rank
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int


class FakeDeepEPBuffer:
    """DeepEP ``Buffer`` semantics on torch ops (sync gloo collectives when ``group`` has several ranks)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.log: list[str] = []
        self.kwargs: list[dict] = []
        self.dtypes: list[tuple[str, torch.dtype]] = []  # (call, dtype of the activations it was given)

    # -- collectives (synchronous: the dispatcher's comm point wraps the whole call) --
    def _a2a(self, x: Tensor, out_splits: list[int], in_splits: list[int]) -> Tensor:
        if self.size == 1:
            return x.clone()
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=self.group)
        return out

    def capture(self) -> FakeEvent:
        self.log.append("capture")
        return FakeEvent(self.log, "captured")

    def get_dispatch_layout(
        self, topk_idx, num_experts, previous_event=None, async_finish=False, allocate_on_comm_stream=False
    ):
        self.log.append("layout")
        self.kwargs.append({"async_finish": async_finish, "previous_event": previous_event})
        local = num_experts // self.size
        rank_of = torch.where(topk_idx >= 0, torch.div(topk_idx, local, rounding_mode="floor"), -1)
        in_rank = torch.stack([(rank_of == g).any(dim=1) for g in range(self.size)], dim=1)
        per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts)
        self.num_experts = num_experts
        return in_rank.sum(0), None, per_expert, in_rank, FakeEvent(self.log, "layout")

    def dispatch(
        self,
        x,
        handle=None,
        num_tokens_per_rank=None,
        num_tokens_per_rdma_rank=None,
        is_token_in_rank=None,
        num_tokens_per_expert=None,
        topk_idx=None,
        topk_weights=None,
        expert_alignment=1,
        config=None,
        previous_event=None,
        async_finish=False,
        allocate_on_comm_stream=False,
    ):
        self.log.append("dispatch" if handle is None else "dispatch(cached)")
        self.dtypes.append((self.log[-1], x.dtype))
        self.kwargs.append({"async_finish": async_finish, "previous_event": previous_event})
        if handle is not None:
            recv_x = self._a2a(x[handle.send_token_ids], handle.recv_splits, handle.send_splits)
            return recv_x, None, None, None, None, FakeEvent(self.log, "dispatch")
        local = self.num_experts // self.size
        ids, idx_rows, w_rows, send_splits = [], [], [], []
        for g in range(self.size):
            tokens = is_token_in_rank[:, g].nonzero().flatten()
            idx = topk_idx[tokens]
            mine = (idx >= g * local) & (idx < (g + 1) * local)
            ids.append(tokens)
            idx_rows.append(torch.where(mine, idx - g * local, torch.full_like(idx, -1)))
            w_rows.append(topk_weights[tokens])
            send_splits.append(tokens.numel())
        counts = self._a2a(torch.tensor(send_splits), [1] * self.size, [1] * self.size)
        recv_splits = counts.tolist()
        send_ids = torch.cat(ids)
        recv_x = self._a2a(x[send_ids], recv_splits, send_splits)
        recv_idx = self._a2a(torch.cat(idx_rows), recv_splits, send_splits)
        recv_w = self._a2a(torch.cat(w_rows), recv_splits, send_splits)
        per_expert = torch.bincount(recv_idx[recv_idx >= 0], minlength=local).tolist()
        layout = FakeLayoutHandle(send_ids, send_splits, recv_splits, x.shape[0])
        return recv_x, recv_idx, recv_w, per_expert, layout, FakeEvent(self.log, "dispatch")

    def combine(
        self,
        x,
        handle,
        topk_weights=None,
        bias=None,
        config=None,
        previous_event=None,
        async_finish=False,
        allocate_on_comm_stream=False,
    ):
        self.log.append("combine")
        self.dtypes.append(("combine", x.dtype))
        self.kwargs.append({"async_finish": async_finish, "previous_event": previous_event})
        back = self._a2a(x, handle.send_splits, handle.recv_splits)
        out = torch.zeros(handle.num_tokens, *x.shape[1:], dtype=x.dtype).index_add(0, handle.send_token_ids, back)
        combined_w = None
        if topk_weights is not None:
            back_w = self._a2a(topk_weights, handle.send_splits, handle.recv_splits)
            combined_w = torch.zeros(handle.num_tokens, *topk_weights.shape[1:], dtype=topk_weights.dtype)
            combined_w = combined_w.index_add(0, handle.send_token_ids, back_w)
        return out, combined_w, FakeEvent(self.log, "combine")


class CountingRuntime(CommRuntime):
    def __init__(self, delay_wgrad: bool = False, communicator=None) -> None:  # noqa: ANN001
        super().__init__(delay_wgrad=delay_wgrad, communicator=communicator)
        self.handoffs = 0
        self.waits = 0

    def handoff(self) -> None:
        self.handoffs += 1
        super().handoff()

    def wait(self, work):  # type: ignore[no-untyped-def]
        self.waits += 1
        return super().wait(work)


def _routing(T: int, K: int, E: int, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = (
        torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        if T
        else torch.zeros(0, K, dtype=torch.long)
    )
    # float32-representable values: DeepEP carries routing weights in float32.
    w = torch.rand(T, K, generator=g).double()
    return idx, w


@pytest.mark.parametrize("top_k", [1, 2])
def test_flex_matches_alltoall_on_one_rank_forward_and_backward(top_k: int) -> None:
    torch.manual_seed(0)
    E, D, F, T = 4, 8, 6, 7
    experts = Experts(E, D, F, impl="loop", dtype=torch.float64)
    x = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    idx, w = _routing(T, top_k, E, seed=1)
    idx[0, 0] = E  # a dropped choice (HF convention) must be ignored
    w.requires_grad_(True)
    ref = experts(x, idx, w)
    g = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, [x, w, experts.gate_up_proj, experts.down_proj], g)

    buffer = FakeDeepEPBuffer()
    runtime = CountingRuntime()
    flex = FlexDispatcher(None, E, runtime, deepep_buffer=buffer)
    with runtime.attach(CommTimer()) as timer:
        x_RD, splits, handle = flex.dispatch(x, idx, w)
        y_RD = grouped_mlp(x_RD, splits, experts.gate_up_proj, experts.down_proj, experts.act_fn, runtime)
        out = flex.combine(y_RD, handle)
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
        grads = torch.autograd.grad(out, [x, w, experts.gate_up_proj, experts.down_proj], g)
    assert timer.snapshot().waits == 4  # every DeepEP event is waited on through the runtime
    for name, got, want in zip(["x", "w", "gate_up", "down"], grads, ref_grads):
        # DeepEP carries the routing-weight gradient in float32 (its combine takes float32 top-k weights).
        tol = 1e-6 if name == "w" else 1e-12
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=name)
    # Forward: layout, dispatch, combine. Backward: the combine's backward is a cached dispatch, and the
    # dispatch's backward a combine.
    calls = [c for c in buffer.log if not c.startswith("wait") and c != "capture"]
    assert calls == ["layout", "dispatch", "combine", "dispatch(cached)", "combine"]
    assert all(k["async_finish"] for k in buffer.kwargs)
    assert all(k["previous_event"] is not None for k in buffer.kwargs)
    # Every comm kernel waited on only after the hand-over: one hand-over per dispatch/combine, forward and backward.
    assert runtime.handoffs == 4
    assert buffer.log.count("wait:dispatch") == 2 and buffer.log.count("wait:combine") == 2
    assert dataclass_is_frozen(handle)


def dataclass_is_frozen(obj: object) -> bool:
    return bool(type(obj).__dataclass_params__.frozen)


def test_flex_hands_over_before_waiting() -> None:
    buffer = FakeDeepEPBuffer()

    class Probe(CommRuntime):
        def handoff(self) -> None:
            buffer.log.append("handoff")
            super().handoff()

    flex = FlexDispatcher(None, 2, Probe(), deepep_buffer=buffer)
    x = torch.randn(3, 4)
    idx, w = _routing(3, 1, 2, seed=0)
    x_RD, _, handle = flex.dispatch(x, idx, w.float())
    flex.combine(x_RD, handle)
    log = buffer.log
    assert log.index("handoff") < log.index("wait:dispatch")
    assert log.index("combine") < log.index("wait:combine")
    assert log[log.index("wait:combine") - 1] == "handoff"


def test_ep_experts_with_flex_via_apply_expert_parallel() -> None:
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"experts": Experts(4, 8, 4, dtype=torch.float64)})
    ref = Experts(4, 8, 4, dtype=torch.float64)
    ref.load_state_dict(model["experts"].state_dict())
    (ep,) = apply_expert_parallel(
        model, None, dispatcher="flex", runtime=CommRuntime(), deepep_buffer=FakeDeepEPBuffer()
    )
    x = torch.randn(5, 8, dtype=torch.float64)
    idx, w = _routing(5, 2, 4, seed=3)
    torch.testing.assert_close(ep(x, idx, w), ref(x, idx, w))


def test_require_flex_backend_without_deep_ep(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # makes `import deep_ep` fail
    with pytest.raises(ImportError, match=r"pip install -e \"\.\[deepep\]\"` in a source checkout, or `pip install \"lightning-moe-overlap\[deepep\]\""):
        require_flex_backend()
    with pytest.raises(ImportError, match="DeepEP package"):
        build_dispatcher("flex", None, 4, None)


def test_a_deep_ep_whose_import_fails_is_named_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    real = importlib.import_module

    def failing(name, *args):
        if name == "deep_ep":
            raise AssertionError("NCCL version mismatch")  # what DeepEP's own import check raises
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", failing)
    with pytest.raises(ImportError, match=r"is installed but its import failed \(AssertionError: NCCL version "
                                          r"mismatch\).*reinstall it for this torch and CUDA with .*deepep.*"
                                          r"dispatcher='alltoall'"):
        require_flex_backend()


def test_the_index_dtype_is_deep_eps_build_option() -> None:
    build = types.ModuleType("deep_ep")
    assert index_dtype(build) == torch.int64  # a build that does not say
    build.topk_idx_t = torch.int32
    assert index_dtype(build) == torch.int32


def test_require_flex_backend_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deep_ep", types.ModuleType("deep_ep"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ImportError, match="needs CUDA"):
        require_flex_backend()


@pytest.mark.parametrize("num_sms", [0, 3, -2, True])
def test_flex_num_sms_must_be_positive_even(num_sms: int) -> None:
    with pytest.raises(ValueError, match="deepep_num_sms=.* must be a positive even integer"):
        FlexDispatcher(None, 4, None, deepep_num_sms=num_sms, deepep_buffer=FakeDeepEPBuffer())


def test_flex_needs_a_group_for_a_real_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deep_ep", types.ModuleType("deep_ep"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="ep_group=None; DeepEP builds its buffer on a process group"):
        FlexDispatcher(None, 4, None)


def test_flex_and_alltoall_handles_are_per_call() -> None:
    """Two dispatches in flight on one dispatcher: combine each with its own handle, in reverse order."""
    torch.manual_seed(0)
    E, D = 4, 8
    for dispatcher in (
        AllToAllDispatcher(None, E, None),
        FlexDispatcher(None, E, None, deepep_buffer=FakeDeepEPBuffer()),
    ):
        xa, xb = torch.randn(5, D, dtype=torch.float64), torch.randn(3, D, dtype=torch.float64)
        ia, wa = _routing(5, 2, E, seed=1)
        ib, wb = _routing(3, 2, E, seed=2)
        ra, _, ha = dispatcher.dispatch(xa, ia, wa)
        rb, _, hb = dispatcher.dispatch(xb, ib, wb)
        out_b = dispatcher.combine(rb * 2, hb)
        out_a = dispatcher.combine(ra * 2, ha)
        torch.testing.assert_close(out_a, 2 * xa * wa.sum(1, keepdim=True))
        torch.testing.assert_close(out_b, 2 * xb * wb.sum(1, keepdim=True))
