"""``MoELayer``: equal to Hugging Face's Qwen3-MoE block with the same weights; shared-expert overlap."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_moe_overlap.moe import MoELayer, apply_expert_parallel
from lightning_moe_overlap.overlap.runtime import CommRuntime
from tests.helpers.tolerance import reordered_sum_tol, softmax_tol
from tests.unit.test_dispatch_flex import FakeDeepEPBuffer


def test_layer_equals_hf_qwen3_moe_block() -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=16, moe_intermediate_size=8, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True
    )
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    hf = Qwen3MoeSparseMoeBlock(config).double()
    ours = MoELayer(16, 8, 6, 2, experts_impl="grouped").double()
    with torch.no_grad():
        hf.gate.weight.normal_()
        hf.experts.gate_up_proj.normal_(std=0.1)
        hf.experts.down_proj.normal_(std=0.1)
        ours.gate.weight.copy_(hf.gate.weight)
        ours.experts.gate_up_proj.copy_(hf.experts.gate_up_proj)
        ours.experts.down_proj.copy_(hf.experts.down_proj)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    # Both compute the routing weights in float32 from the float64 logits, in other orders (HF: softmax over the 6
    # experts, top-2, renormalised; megatron-core: top-2 of the logits, softmax over them): softmax_tol over the
    # experts (logits rounded once: width 0) and the renormalisation (2 terms and a division), relatively; their
    # backward in float32 sums over the experts once more. Everything else is float64 (n * 2**-53: negligible).
    # Each output / gradient entry is a sum of terms carrying at most that relative error: relative to the entry
    # and, for entries summed from terms of both signs, to the largest entry (a proxy for the sum of the terms'
    # absolute values).
    logits = x.reshape(-1, 16) @ hf.gate.weight.detach().T
    rel = softmax_tol(6, logits.abs().max().item(), 0) + reordered_sum_tol(2 + 2, 1.0) + reordered_sum_tol(6, 1.0)

    def close(got: torch.Tensor, want: torch.Tensor) -> None:
        torch.testing.assert_close(got, want, rtol=rel, atol=rel * want.abs().max().item())

    close(ours(x1), hf(x2))
    ours(x1).sum().backward()
    hf(x2).sum().backward()
    close(x1.grad, x2.grad)
    close(ours.gate.weight.grad, hf.gate.weight.grad)
    close(ours.experts.gate_up_proj.grad, hf.experts.gate_up_proj.grad)


class RecordingRuntime(CommRuntime):
    def __init__(self) -> None:
        super().__init__()
        self.handoffs = 0

    def handoff(self) -> None:
        self.handoffs += 1
        super().handoff()


# The token dispatch's hand-over: after the count exchange (alltoall), the size all-gather (allgather); flex has one.
@pytest.mark.parametrize("dispatcher, handover", [("alltoall", 2), ("allgather", 2), ("flex", 1)])
def test_shared_expert_runs_at_the_token_dispatch(dispatcher: str, handover: int) -> None:
    torch.manual_seed(0)
    ref = MoELayer(8, 4, 4, 2, shared_expert_ffn_hidden_size=6, shared_expert_overlap=True).double()
    layer = copy.deepcopy(ref)
    runtime = RecordingRuntime()
    knobs = {"deepep_buffer": FakeDeepEPBuffer()} if dispatcher == "flex" else {}
    apply_expert_parallel(layer, None, dispatcher=dispatcher, runtime=runtime, **knobs)
    seen: list[tuple[int, bool]] = []
    layer.shared_experts.register_forward_hook(lambda *_: seen.append((runtime.handoffs, torch.is_grad_enabled())))
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    out = layer(x)
    # It ran inside the token dispatch's hand-over (the counter is bumped before the queued work runs), not at the
    # metadata exchange before it, with grad enabled even though that hand-over sits inside an autograd function.
    assert seen == [(handover, True)]
    torch.testing.assert_close(out, ref(x))
    out.sum().backward()
    ref(x).sum().backward()
    for (name, a), (_, b) in zip(layer.shared_experts.named_parameters(), ref.shared_experts.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_shared_expert_overlap_without_runtime_runs_inline() -> None:
    torch.manual_seed(0)
    a = MoELayer(8, 4, 4, 1, shared_expert_ffn_hidden_size=6, shared_expert_overlap=True).double()
    b = copy.deepcopy(a)
    b.shared_expert_overlap = False
    x = torch.randn(4, 8, dtype=torch.float64)
    torch.testing.assert_close(a(x), b(x))


def test_shared_expert_overlap_needs_shared_experts() -> None:
    with pytest.raises(ValueError, match="shared_expert_overlap=True but shared_expert_ffn_hidden_size=None"):
        MoELayer(8, 4, 4, 1, shared_expert_overlap=True)


def test_no_grad_forward_builds_no_graph() -> None:
    layer = MoELayer(8, 4, 4, 2, shared_expert_ffn_hidden_size=4, shared_expert_overlap=True)
    apply_expert_parallel(layer, None, runtime=CommRuntime())
    with torch.no_grad():
        out = layer(torch.randn(3, 8))
    assert not out.requires_grad
