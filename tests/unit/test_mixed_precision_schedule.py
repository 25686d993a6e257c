"""Mixed precision through the schedule, single process: ``MoEGPT`` and HF Qwen3-MoE with their experts made
expert-parallel (ep=1), trained under ``torch.autocast("cpu", bf16 | fp16)`` with the loop and the grouped
GEMMs, sequential and overlapped (with and without delayed wgrad): the parameters are bitwise equal across the
schedules, and they moved. As Lightning does, the forward runs under autocast and the backward outside it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.moe.ep import apply_expert_parallel
from lightning_moe_overlap.overlap.engine import OverlapEngine
from lightning_moe_overlap.overlap.runtime import CommRuntime

MICRO, STEPS, SEQ = 3, 2, 9
SCHEDULES = [(False, False), (True, False), (True, True), (False, True)]  # (overlap, delay_wgrad)


def _moegpt() -> tuple[nn.Module, callable]:
    model = MoEGPT(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_experts=4, top_k=2,
                   ffn_hidden_size=16, seed=0)
    return model, model._loss


def _qwen3() -> tuple[nn.Module, callable]:
    pytest.importorskip("transformers", reason="Requires: transformers>=5")
    from lightning_moe_overlap.demo_hf import build_hf_model

    torch.manual_seed(0)
    model = build_hf_model("qwen3_moe", vocab_size=64)
    return model, lambda tokens: model(input_ids=tokens, labels=tokens).loss


def _train(build, amp_dtype: torch.dtype, impl: str, overlap: bool, delay: bool) -> list[torch.Tensor]:
    model, loss_fn = build()
    runtime = CommRuntime(delay_wgrad=delay)
    apply_expert_parallel(model, None, runtime=runtime, impl=impl)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = OverlapEngine(runtime, overlap=overlap, timeout_s=60)
    g = torch.Generator().manual_seed(11)
    for _ in range(STEPS):
        tokens = torch.randint(0, 64, (MICRO, 2, SEQ), generator=g)
        opt.zero_grad()

        def forward(i: int) -> torch.Tensor:
            with torch.autocast("cpu", dtype=amp_dtype):
                return loss_fn(tokens[i])

        engine.run(forward, lambda i, loss: (loss / MICRO).backward(), MICRO)
        assert runtime.pending_wgrad == 0
        for p in model.parameters():
            assert p.grad is None or (p.grad.dtype == p.dtype and torch.isfinite(p.grad).all())
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("impl", ["loop", "grouped_mm"])
@pytest.mark.parametrize("amp_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("model", ["moegpt", "qwen3_moe"])
def test_mixed_precision_overlap_is_bitwise_equal_to_sequential(model: str, amp_dtype: torch.dtype, impl: str) -> None:
    build = _moegpt if model == "moegpt" else _qwen3
    torch.manual_seed(0)
    initial = [p.detach().clone() for p in build()[0].parameters()]
    reference = _train(build, amp_dtype, impl, *SCHEDULES[0])
    assert any(not torch.equal(a, b) for a, b in zip(reference, initial))  # training moved the weights
    for overlap, delay in SCHEDULES[1:]:
        got = _train(build, amp_dtype, impl, overlap, delay)
        for i, (a, b) in enumerate(zip(got, reference)):
            assert torch.equal(a, b), f"{model} {amp_dtype} {impl} overlap={overlap} delay={delay}: parameter {i}"
