"""DeepEP prerequisites on the flex path: one buffer per process for N layers, and bfloat16 on the wire.

Against the DeepEP test double (``FakeDeepEPBuffer``), which records the dtype of every activation tensor handed
to ``dispatch`` / ``combine``: real DeepEP asserts bfloat16 there.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_moe_overlap.moe import DeepEPBuffers, Experts, apply_expert_parallel
from lightning_moe_overlap.moe import ep as ep_module
from lightning_moe_overlap.moe.dispatch import AllToAllDispatcher, FlexDispatcher
from lightning_moe_overlap.moe.grouped import grouped_mlp
from lightning_moe_overlap.overlap.runtime import CommRuntime
from tests.unit.test_dispatch_flex import FakeDeepEPBuffer, _routing


class CountingFactory:
    def __init__(self) -> None:
        self.calls: list[tuple[object, int]] = []
        self.buffers: list[FakeDeepEPBuffer] = []

    def __call__(self, group: object, hidden_bytes: int) -> FakeDeepEPBuffer:
        self.calls.append((group, hidden_bytes))
        self.buffers.append(FakeDeepEPBuffer())
        return self.buffers[-1]


def _model(num_layers: int, hidden: int = 8) -> nn.ModuleDict:
    torch.manual_seed(0)
    return nn.ModuleDict({f"l{i}": nn.ModuleDict({"experts": Experts(4, hidden, 6)}) for i in range(num_layers)})


def _run(ep_modules, x: torch.Tensor) -> torch.Tensor:
    idx, w = _routing(x.shape[0], 2, 4, seed=5)
    for m in ep_modules:
        x = x + m(x, idx, w.float())
    return x


def test_one_buffer_for_all_layers_of_a_model() -> None:
    factory = CountingFactory()
    buffers = DeepEPBuffers(buffer_factory=factory)
    ep_modules = apply_expert_parallel(
        _model(4), None, dispatcher="flex", runtime=CommRuntime(), deepep_buffers=buffers
    )
    assert all(m.dispatcher.buffers is buffers for m in ep_modules)
    x = torch.randn(5, 8, requires_grad=True)
    _run(ep_modules, x).sum().backward()
    _run(ep_modules, x.detach()).sum()  # a second micro-batch reuses it
    assert buffers.num_built == 1 and len(factory.calls) == 1
    assert factory.calls == [(None, 8 * 2)]  # sized for a bfloat16 row of the hidden size
    log = factory.buffers[0].log
    # 4 layers x 2 forwards, and the first forward's backward (a cached dispatch and a combine per layer).
    assert (log.count("dispatch"), log.count("dispatch(cached)"), log.count("combine")) == (8, 4, 12)


def test_apply_expert_parallel_makes_one_provider_for_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[DeepEPBuffers] = []

    def provider(num_sms: int) -> DeepEPBuffers:
        made.append(DeepEPBuffers(num_sms, buffer_factory=CountingFactory()))
        return made[-1]

    monkeypatch.setattr(ep_module, "DeepEPBuffers", provider)
    ep_modules = apply_expert_parallel(_model(3), None, dispatcher="flex", runtime=None, deepep_num_sms=24)
    assert len(made) == 1 and made[0].num_sms == 24
    assert {id(m.dispatcher.buffers) for m in ep_modules} == {id(made[0])}
    _run(ep_modules, torch.randn(4, 8))
    assert made[0].num_built == 1


def test_buffer_grows_for_a_wider_layer_and_is_kept_per_group() -> None:
    factory = CountingFactory()
    buffers = DeepEPBuffers(buffer_factory=factory)
    group_a, group_b = object(), object()
    first = buffers.get(group_a, 1024)
    assert buffers.get(group_a, 512) is first  # a narrower layer fits in the existing buffer
    assert buffers.get(group_a, 1024) is first
    wider = buffers.get(group_a, 4096)
    assert wider is not first and buffers.get(group_a, 1024) is wider  # grown once, then shared again
    other = buffers.get(group_b, 1024)
    assert other is not wider
    assert buffers.num_built == 3 and [nbytes for _, nbytes in factory.calls] == [1024, 4096, 1024]
    assert buffers.row_bytes(2048, torch.float32) == 4096  # bfloat16 on the wire
    assert DeepEPBuffers(wire_dtype=None, buffer_factory=factory).row_bytes(2048, torch.float32) == 8192


def test_flex_sends_bfloat16_under_float32_input_forward_and_backward() -> None:
    torch.manual_seed(0)
    E, D, T = 4, 8, 7
    experts = Experts(E, D, 6, impl="loop")
    factory = CountingFactory()
    flex = FlexDispatcher(None, E, CommRuntime(), deepep_buffers=DeepEPBuffers(buffer_factory=factory))
    ref = AllToAllDispatcher(None, E, None)
    idx, w = _routing(T, 2, E, seed=1)
    w = w.float()
    x = torch.randn(T, D, requires_grad=True)
    outs, grads = [], []
    for dispatcher in (flex, ref):
        x_RD, splits, handle = dispatcher.dispatch(x, idx, w)
        assert x_RD.dtype == torch.float32  # the experts see the caller's dtype
        y_RD = grouped_mlp(x_RD, splits, experts.gate_up_proj, experts.down_proj, experts.act_fn, None, impl="loop")
        out = dispatcher.combine(y_RD, handle)
        outs.append(out)
        grads.append(torch.autograd.grad(out.square().sum(), x)[0])
    fake = factory.buffers[0]
    assert fake.dtypes == [
        ("dispatch", torch.bfloat16),
        ("combine", torch.bfloat16),
        ("dispatch(cached)", torch.bfloat16),  # the combine's backward
        ("combine", torch.bfloat16),  # the dispatch's backward
    ]
    assert outs[0].dtype == torch.float32 and grads[0].dtype == torch.float32
    # bfloat16 rounding on the wire (8-bit mantissa), otherwise the same math as the float32 all-to-all.
    torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(grads[0], grads[1], atol=5e-2, rtol=5e-2)
    assert not torch.equal(outs[0], outs[1])  # the cast happened


def test_flex_keeps_bfloat16_input_as_is() -> None:
    fake = FakeDeepEPBuffer()
    flex = FlexDispatcher(None, 2, None, deepep_buffers=DeepEPBuffers(buffer_factory=lambda g, n: fake))
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    idx, w = _routing(3, 1, 2, seed=0)
    x_RD, _, handle = flex.dispatch(x, idx, w.float())
    out = flex.combine(x_RD, handle)
    assert out.dtype == torch.bfloat16 and [d for _, d in fake.dtypes] == [torch.bfloat16] * 2
    torch.testing.assert_close(out, x * w.float().sum(1, keepdim=True).to(torch.bfloat16))


def test_deepep_buffers_errors() -> None:
    with pytest.raises(ValueError, match=r"`DeepEPBuffers`: deepep_num_sms=5 must be a positive even integer"):
        DeepEPBuffers(5)
    with pytest.raises(TypeError, match=r"wire_dtype='bf16' is not a torch.dtype; pass torch.bfloat16"):
        DeepEPBuffers(wire_dtype="bf16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"got both deepep_buffers and deepep_buffer.*not both"):
        FlexDispatcher(None, 4, None, deepep_buffers=DeepEPBuffers(), deepep_buffer=FakeDeepEPBuffer())


def test_real_buffer_needs_a_group(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_moe_overlap.moe.dispatch.deepep_buffers import build_deepep_buffer

    with pytest.raises(ValueError, match=r"`DeepEPBuffers`: group=None; DeepEP builds its buffer on a process group"):
        build_deepep_buffer(None, 1024, 20)
