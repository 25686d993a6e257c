"""``shared_expert_overlap``: the shared experts of this package's and HF blocks run inside the dispatch window
(after the dispatch is issued, before it is waited on), bitwise equal to running them inline."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_moe_overlap.moe import MoELayer, apply_expert_parallel
from lightning_moe_overlap.overlap.runtime import CommRuntime
from tests.helpers.tolerance import reordered_sum_tol


class EventRuntime(CommRuntime):
    """Logs hand-overs and waits."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []

    def handoff(self) -> None:
        self.events.append("handoff")
        super().handoff()

    def wait(self, work):  # noqa: ANN001, ANN201
        self.events.append("wait")
        return super().wait(work)


def qwen2_block() -> tuple[torch.nn.Module, str]:
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    config = Qwen2MoeConfig(hidden_size=16, moe_intermediate_size=8, shared_expert_intermediate_size=12,
                            num_experts=4, num_experts_per_tok=2)
    config._experts_implementation = "eager"
    return Qwen2MoeSparseMoeBlock(config), "shared_expert"


def deepseek_block() -> tuple[torch.nn.Module, str]:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = DeepseekV3Config(hidden_size=16, moe_intermediate_size=8, n_routed_experts=4, num_experts_per_tok=2,
                              n_group=2, topk_group=1, n_shared_experts=1)
    config._experts_implementation = "eager"
    return DeepseekV3MoE(config), "shared_experts"


def own_block() -> tuple[torch.nn.Module, str]:
    return MoELayer(16, 8, 4, 2, shared_expert_ffn_hidden_size=12), "shared_experts"


@pytest.mark.parametrize("make", [qwen2_block, deepseek_block, own_block], ids=["qwen2_moe", "deepseek_v3", "own"])
def test_shared_experts_run_in_the_dispatch_window_bitwise_equal(make) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    block, shared_name = make()
    with torch.no_grad():
        for p in block.parameters():  # HF blocks built alone are not initialised
            p.normal_(0.0, 0.2)
    ref = copy.deepcopy(block)
    runtime, ref_runtime = EventRuntime(), EventRuntime()
    apply_expert_parallel(block, None, runtime=runtime, shared_expert_overlap=True)
    apply_expert_parallel(ref, None, runtime=ref_runtime, shared_expert_overlap=False)
    shared = getattr(block, shared_name)
    last = list(shared.modules())[-1] if not hasattr(shared, "down_proj") else shared.down_proj
    # The real forward (the zero-row probe that sizes the Qwen2 placeholder is not counted).
    last.register_forward_hook(lambda m, args, out: runtime.events.append("shared") if out.numel() else None)
    x = torch.randn(2, 5, 16)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, want = block(x1), ref(x2)
    # Inside the window: after the first hand-over (the dispatch issue), before the first wait.
    assert runtime.events.index("shared") > runtime.events.index("handoff")
    if "wait" in runtime.events:
        assert runtime.events.index("shared") < runtime.events.index("wait")
    assert runtime.events.count("shared") == 1
    assert torch.equal(out, want)
    out.square().sum().backward()
    want.square().sum().backward()
    if make is qwen2_block:
        # The block's input feeds the shared MLP twice (gate_proj, up_proj); created later, those two gradients
        # reach it in another order (docs/overlap.md): the input's gradient is a sum of 6 contributions (the router,
        # the 2 experts of each token, gate_proj, up_proj, the shared expert's gate) added in another order:
        # reordered_sum_tol(6) relative to the entry and to the largest entry (a proxy for the sum of the
        # contributions' absolute values, not at hand; tests/helpers/tolerance.py).
        rel = reordered_sum_tol(6, 1.0)
        torch.testing.assert_close(x1.grad, x2.grad, rtol=rel, atol=rel * x2.grad.abs().max().item())
    else:
        assert torch.equal(x1.grad, x2.grad)
    for (name, a), (_, b) in zip(block.named_parameters(), ref.named_parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_shared_window_outside_training_and_without_grad() -> None:
    torch.manual_seed(0)
    block, _ = qwen2_block()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.2)
    ref = copy.deepcopy(block)
    apply_expert_parallel(block, None, runtime=CommRuntime(), shared_expert_overlap=True)
    apply_expert_parallel(ref, None, runtime=CommRuntime())
    x = torch.randn(3, 16).view(1, 3, 16)
    with torch.no_grad():
        assert torch.equal(block.eval()(x), ref.eval()(x))


def test_strategy_flag_reaches_the_layers() -> None:
    from types import SimpleNamespace

    from lightning_moe_overlap.config import OverlapConfig
    from lightning_moe_overlap.demo import MoEGPT
    from lightning_moe_overlap.moe.model_handle import MoEModelHandle

    def wrapped(flag: bool) -> MoEGPT:
        model = MoEGPT(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, num_experts=4,
                       shared_expert_ffn_hidden_size=8)
        config = OverlapConfig(overlap=False, shared_expert_overlap=flag)
        MoEModelHandle(model).apply(config, SimpleNamespace(ep=None), EventRuntime())
        return model

    on, off = wrapped(True), wrapped(False)
    assert [layer.mlp.shared_expert_overlap for layer in on.layers] == [True, True]
    assert [layer.mlp.shared_expert_overlap for layer in off.layers] == [False, False]
    tokens = torch.randint(0, 32, (2, 6))
    assert torch.equal(on(tokens), off(tokens))
    assert on.layers[0].mlp.runtime.events.count("handoff") > 0


@pytest.mark.parametrize("make", [qwen2_block, deepseek_block], ids=["qwen2_moe", "deepseek_v3"])
def test_the_window_replaces_nothing_on_the_shared_experts(make) -> None:  # noqa: ANN001
    """The window redirects the block's call through the shared module's own hooks: no instance ``forward`` (or any
    other attribute) is set on it, its hooks run once per block call (on the zero rows the pre-hook hands its
    forward), and removing the window leaves the module as it was built."""
    from lightning_moe_overlap.moe.shared import overlap_shared_experts  # noqa: PLC0415 - the unit under test

    torch.manual_seed(0)
    block, shared_name = make()
    shared = getattr(block, shared_name)
    before = dict(shared.__dict__)
    window = overlap_shared_experts(block, CommRuntime())
    assert window is not None and "forward" not in shared.__dict__
    assert {k: v for k, v in shared.__dict__.items() if k not in ("_forward_pre_hooks", "_forward_hooks",
                                                                 "_forward_pre_hooks_with_kwargs",
                                                                 "_forward_hooks_with_kwargs")} == {
        k: v for k, v in before.items() if k not in ("_forward_pre_hooks", "_forward_hooks",
                                                     "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs")}
    seen: list[int] = []
    shared.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    stage_calls: list[tuple[int, ...]] = []
    block.shared_stage.register_forward_hook(lambda m, args, out: stage_calls.append(tuple(args[0].shape)))
    with torch.no_grad():
        block(torch.randn(2, 5, 16))
    assert seen == [0]  # the block's one call, on zero rows
    assert len(stage_calls) == 1 and torch.Size(stage_calls[0]).numel() == 2 * 5 * 16  # the real rows, once
    window.remove()
    assert not hasattr(block, "shared_stage") and "forward" not in shared.__dict__
