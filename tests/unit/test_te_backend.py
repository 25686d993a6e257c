"""``expert_backend="te"`` without Transformer Engine: the wiring, checked against a stand-in ``GroupedLinear``.

The stand-in has TE's interface and semantics as the TE backend relies on them: ``GroupedLinear(num_gemms,
in_features, out_features, bias, params_dtype, device, delay_wgrad_compute)`` with parameters ``weight{i}``
``[out, in]``, ``forward(inp, m_splits: list)``, a backward that computes dgrad only and queues the wgrad work, and
``backward_dw()`` that pops the oldest and *sets* each ``weight{i}.grad``. With it the TE path must give the
torch backend's results (float64, the loop kernel), accumulate over micro-batches, defer through
``delay_wgrad``, stay bitwise equal under the overlapped schedule, and leave parameters and checkpoints as they
were. Real TE numerics are checked on GPU (``tests/gpu/test_te_experts_cuda.py``).
"""

from __future__ import annotations

import types
from collections import deque

import pytest
import torch
from torch import nn

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.config import OverlapConfig
from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.moe import te_backend
from lightning_moe_overlap.moe.ep import apply_expert_parallel
from lightning_moe_overlap.moe.experts import Experts
from lightning_moe_overlap.moe.te_backend import TEProjection, check_te_layout
from lightning_moe_overlap.moe.experts_layout import ExpertsLayout
from lightning_moe_overlap.overlap.engine import OverlapEngine
from lightning_moe_overlap.overlap.runtime import CommRuntime
from lightning_moe_overlap.validation import check_config, check_machine, raise_problems


class _FakeGroupedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, m_splits, module, *weights):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x, *weights)
        ctx.m_splits, ctx.module = m_splits, module
        return torch.cat([x_e @ w.T for x_e, w in zip(x.split(m_splits), weights)])

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        x, *weights = ctx.saved_tensors
        dx = torch.cat([g_e @ w for g_e, w in zip(g.split(ctx.m_splits), weights)])
        ctx.module.store.append((x, g, ctx.m_splits))  # delay_wgrad_compute: the wgrad waits for backward_dw
        return (dx, None, None, *[None] * len(weights))


class FakeGroupedLinear(nn.Module):
    built = 0

    def __init__(self, num_gemms, in_features, out_features, bias=True, params_dtype=None, device=None,  # noqa: ANN001
                 delay_wgrad_compute=False):
        super().__init__()
        assert bias is False and delay_wgrad_compute is True
        FakeGroupedLinear.built += 1
        self.num_gemms, self.built_on = num_gemms, str(device)
        for i in range(num_gemms):
            w = torch.empty(out_features, in_features, dtype=params_dtype, device=device)
            self.register_parameter(f"weight{i}", nn.Parameter(w))
        self.store: deque = deque()

    def forward(self, inp, m_splits):  # noqa: ANN001, ANN201
        assert isinstance(m_splits, list) and len(m_splits) == self.num_gemms
        weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
        return _FakeGroupedLinearFn.apply(inp, m_splits, self, *weights)

    def backward_dw(self) -> None:
        if not self.store:
            return  # as TE: an empty queue returns silently
        x, g, m_splits = self.store.popleft()
        for i, (x_e, g_e) in enumerate(zip(x.split(m_splits), g.split(m_splits))):
            getattr(self, f"weight{i}").grad = g_e.T @ x_e  # set, not accumulated (as TE without fused accumulation)


FAKE_TE = types.SimpleNamespace(GroupedLinear=FakeGroupedLinear)


@pytest.fixture
def fake_te(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(te_backend, "import_te", lambda owner="": FAKE_TE)


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.experts = Experts(4, 8, 6, dtype=torch.float64)


def _routing(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 8, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(7)])
    idx[:, 0] = torch.where(idx[:, 0] == 3, 1, idx[:, 0])  # expert 3 only ever second choice: fewer rows
    return x, idx, torch.rand(7, 2, generator=g, dtype=torch.float64)


def _run(backend: str, delay: bool, micro: int = 2) -> tuple[nn.Module, list[torch.Tensor]]:
    holder, runtime = Holder(), CommRuntime(delay_wgrad=delay)
    (ep,) = apply_expert_parallel(holder, None, runtime=runtime, impl="loop", expert_backend=backend)
    deferred, defer = [], runtime.defer_wgrad
    runtime.defer_wgrad = lambda fn: deferred.append(fn) or defer(fn)  # type: ignore[method-assign]
    outs = []
    for m in range(micro):  # several backwards accumulate into .grad, as micro-batches do
        x, idx, w = _routing(m)
        x.requires_grad_()
        out = holder.experts(x, idx, w)
        out.square().sum().backward()
        runtime.flush_wgrad()  # (the dispatch backward's comm point already ran the queue)
        outs += [out.detach(), x.grad]
    assert len(deferred) == 2 * micro  # both projections' wgrad went through the runtime, every micro-batch
    return ep, outs


@pytest.mark.parametrize("delay", [False, True])
def test_te_path_matches_torch_backend(fake_te: None, delay: bool) -> None:
    torch_ep, torch_outs = _run("torch", delay=False)
    te_ep, te_outs = _run("te", delay=delay)
    for a, b in zip(te_outs, torch_outs):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    for name in ("gate_up_proj", "down_proj"):
        got, want = getattr(te_ep, name).grad, getattr(torch_ep, name).grad
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_te_weights_are_views_and_checkpoints_are_unchanged(fake_te: None) -> None:
    torch_ep, _ = _run("torch", delay=False, micro=1)
    te_ep, _ = _run("te", delay=False, micro=1)
    assert list(te_ep.state_dict()) == list(torch_ep.state_dict())  # TE's module is not a submodule
    assert [n for n, _ in te_ep.named_parameters()] == [n for n, _ in torch_ep.named_parameters()]
    projection = te_ep.te_experts.gate_up
    linear = projection.linear()
    for i in range(4):  # weight{i} shares expert i's memory: optimizer steps and loads are seen at once
        assert linear.get_parameter(f"weight{i}").data_ptr() == te_ep.gate_up_proj[i].data_ptr()
    built = FakeGroupedLinear.built
    assert projection.linear() is linear and FakeGroupedLinear.built == built
    te_ep.gate_up_proj.data = te_ep.gate_up_proj.data.clone()  # e.g. model.to(device): new memory
    rebound = projection.linear()  # the same module, bound again: no new build (no allocation, no RNG draw)
    assert rebound is linear and FakeGroupedLinear.built == built and linear.built_on == "meta"
    assert rebound.get_parameter("weight2").data_ptr() == te_ep.gate_up_proj[2].data_ptr()


def test_te_path_overlap_is_bitwise_equal_to_sequential(fake_te: None) -> None:
    """MoEGPT on the TE path through the schedule: TE's wgrad queue stays in step with the runtime's."""

    def train(overlap: bool, delay: bool) -> list[torch.Tensor]:
        model = MoEGPT(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, num_experts=4, top_k=2,
                       ffn_hidden_size=8, seed=0).double()
        runtime = CommRuntime(delay_wgrad=delay)
        apply_expert_parallel(model, None, runtime=runtime, expert_backend="te")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tokens = torch.randint(0, 32, (3, 2, 7), generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            opt.zero_grad()
            OverlapEngine(runtime, overlap=overlap, timeout_s=60).run(
                lambda i: model._loss(tokens[i]), lambda i, loss: (loss / 3).backward(), 3
            )
            assert runtime.pending_wgrad == 0
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    reference = train(False, False)
    for overlap, delay in ((True, False), (True, True), (False, True)):
        for a, b in zip(train(overlap, delay), reference):
            assert torch.equal(a, b)


# -- validation ------------------------------------------------------------------------------------------------
def test_expert_backend_choice_is_validated() -> None:
    with pytest.raises(ValueError, match=r"`expert_backend='cuda'` is not one of \['torch', 'te'\]"):
        raise_problems(check_config(OverlapConfig(expert_backend="cuda")))
    with pytest.raises(ValueError, match=r"`expert_backend='tee'` is not one of"):
        MoEOverlapStrategy(expert_backend="tee", num_microbatches=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"expert_backend='cuda' is not one of \['torch', 'te'\]; pick 'torch'"):
        apply_expert_parallel(Holder(), None, runtime=CommRuntime(), expert_backend="cuda")  # type: ignore[arg-type]


def test_te_needs_cuda_and_transformer_engine() -> None:
    with pytest.raises(ImportError, match=r"`expert_backend='te'` .* needs .*a CUDA device \(the accelerator is 'cpu'\).*"
                       r"pip install -e .*lightning-moe-overlap\[te\].*expert_backend='torch'"):
        raise_problems(check_machine(OverlapConfig(expert_backend="te"), "cpu", cuda_available=False))
    assert check_machine(OverlapConfig(expert_backend="torch"), "cpu", cuda_available=False) == []


def test_import_te_names_the_install_hint() -> None:
    if te_backend.te_available():
        pytest.skip("transformer_engine is installed here")
    with pytest.raises(ImportError, match=r"needs NVIDIA Transformer Engine .*pip install -e .*lightning-moe-overlap\[te\]"):
        te_backend.import_te()
    holder = Holder()  # wrapping needs no TE; the first forward imports it
    apply_expert_parallel(holder, None, runtime=CommRuntime(), expert_backend="te")
    x, idx, w = _routing(0)
    with pytest.raises(ImportError, match=r"pip install -e .*lightning-moe-overlap\[te\]"):
        holder.experts(x, idx, w)


def test_te_rejects_layouts_it_cannot_map() -> None:
    with pytest.raises(NotImplementedError, match=r"these experts have weights stored \[e, in, out\] \(transposed\) "
                       r"and per-expert biases\. Use `expert_backend='torch'`"):
        check_te_layout(ExpertsLayout(act_fn=torch.relu, transposed=True, up_bias_name="b"), owner="`x`")
    check_te_layout(ExpertsLayout(act_fn=torch.relu), owner="`x`")


def test_te_projection_accumulates_into_existing_grad() -> None:
    weight = nn.Parameter(torch.randn(2, 3, 4, dtype=torch.float64))
    projection = TEProjection(weight, FAKE_TE)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    for _ in range(2):
        projection(x, [2, 3], None).sum().backward()
    per_expert = [torch.ones(n, 3, dtype=torch.float64).T @ x_e for n, x_e in zip((2, 3), x.detach().split([2, 3]))]
    torch.testing.assert_close(weight.grad, 2 * torch.stack(per_expert))


def test_a_weight_gradient_run_with_nothing_queued_is_an_error_not_zeros() -> None:
    """TE's ``backward_dw`` returns silently on an empty queue (the stand-in does the same): a run asked for with
    no backward waiting, or one whose queued work something else consumed, raises instead of leaving zeros."""
    weight = nn.Parameter(torch.randn(2, 3, 4, dtype=torch.float64))
    projection = TEProjection(weight, FAKE_TE)
    with pytest.raises(RuntimeError, match=r"weight-gradient run of the experts' \(2, 3, 4\) projection was asked "
                                           r"for with no backward of it waiting"):
        projection.finish_wgrad(projection.linear())
    runtime = CommRuntime(delay_wgrad=True)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    projection(x, [2, 3], runtime).sum().backward()  # the weight-gradient run is queued in the runtime
    projection.linear().backward_dw()  # another caller runs TE's queued work and takes its gradients
    projection.linear().zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match=r"set no weight gradient .* its queue and this backend's disagree"):
        runtime.flush_wgrad()
    assert weight.grad is None
