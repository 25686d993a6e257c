"""A tiny HF Qwen3-MoE (``demo_hf.HFMoECausalLM``) trained 200 steps on CPU in one process, float32 against FP8: the
experts made expert-parallel (ep=1, the all-to-all dispatcher over a loopback exchange, so the tokens go through the
FP8 dispatch), then ``apply_fp8`` (dense linears through torchao, experts through the FP8 kernel). The FP8 run ends
within 3% of the float32 run's loss.

Measured with torch 2.13 and torchao 0.18.0 on CPU (mean loss of the last 20 steps, from 4.86 at the start): float32
3.7596, tensorwise 3.7606 (+0.03%), rowwise 3.7695 (+0.3%); about 2 minutes for the three runs, hence ``long``.
"""

from __future__ import annotations

import pytest
import torch

from lightning_moe_overlap.demo import SyntheticTokens
from lightning_moe_overlap.demo_hf import HFMoECausalLM
from lightning_moe_overlap.fp8 import apply_fp8
from lightning_moe_overlap.moe import apply_expert_parallel
from lightning_moe_overlap.moe.dispatch.loopback import Loopback
from lightning_moe_overlap.overlap.runtime import CommRuntime

STEPS, TAIL, TOLERANCE, VOCAB = 200, 20, 0.03, 128


def _train(recipe: str | None) -> tuple[float, float]:
    """(first loss, mean of the last ``TAIL`` losses) of ``STEPS`` AdamW steps from the same seed and batches."""
    module = HFMoECausalLM("qwen3_moe", lr=3e-3)
    wrapped = apply_expert_parallel(module, None, runtime=CommRuntime(communicator=Loopback(0.0)))
    if recipe is not None:
        report = apply_fp8(module, recipe)
        assert len(report.experts) == len(wrapped) == 2 and len(report.linears) > 0
        assert all(ep.dispatch_recipe() is not None for ep in wrapped)  # the tokens are dispatched in FP8
    optimizer = module.configure_optimizers()
    data = SyntheticTokens(vocab_size=VOCAB, seq_len=32, batch_size=8, num_samples=STEPS * 8, seed=0)
    torch.manual_seed(0)  # the loader's shuffle
    losses = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for batch in data.train_dataloader():
            loss = module._hf_loss(batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    assert len(losses) == STEPS
    return losses[0], sum(losses[-TAIL:]) / TAIL


@pytest.fixture(scope="module")
def float32_run() -> tuple[float, float]:
    return _train(None)


@pytest.mark.long
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_hf_qwen3_moe_fp8_training_ends_within_3_percent_of_float32(recipe: str, float32_run) -> None:
    first, end = _train(recipe)
    first_ref, end_ref = float32_run
    print(f"\nqwen3_moe {recipe}: first {first:.4f} end {end:.4f}; float32 first {first_ref:.4f} end {end_ref:.4f}")
    assert end_ref < first_ref - 0.5 and end < first - 0.5  # both learned
    assert abs(end - end_ref) <= TOLERANCE * end_ref, (end, end_ref)
    assert end != end_ref
