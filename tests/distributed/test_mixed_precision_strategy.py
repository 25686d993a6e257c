"""``MoEOverlapStrategy(ep=2)`` under ``bf16-mixed`` and ``16-mixed`` on 2 gloo ranks: HF Qwen3-MoE and ``MoEGPT``,
the experts on the per-expert loop (what CUDA runs under bf16-mixed with fp32 weights) and on the grouped GEMM.

Oracles per rank: training runs (it crashed in the experts' backward on the loop), the loss is finite, and the
overlapped schedule with delayed weight gradients leaves parameters bitwise equal to the sequential one.
``16-mixed`` goes through Lightning's ``MixedPrecision("16-mixed", "cpu")`` plugin (fp16 autocast on CPU and a
``GradScaler``): the ``Trainer(precision="16-mixed")`` flag itself falls back to bf16 on CPU.
"""

from __future__ import annotations

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.demo_hf import HFMoECausalLM
from lightning_moe_overlap.moe import grouped
from tests.helpers.data import RandomTokens
from tests.helpers.distributed import run_distributed

WORLD, STEPS, BATCH, MICRO = 2, 2, 4, 2


class Tokens(RandomTokens):
    def __init__(self, n: int = 16, seq: int = 8, vocab: int = 64) -> None:
        super().__init__(n, seq, vocab, seed=3)


def _model(name: str):
    if name == "qwen3_moe":
        model = HFMoECausalLM("qwen3_moe", lr=1e-2, config_overrides={"vocab_size": 64})
    else:
        model = MoEGPT(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_experts=4, top_k=2,
                       ffn_hidden_size=16, lr=1e-2)
    model.train_dataloader = lambda: DataLoader(Tokens(), batch_size=BATCH)
    return model


def _fit(name: str, precision: str, loop: bool, overlap: bool) -> tuple[list[float], list[torch.Tensor]]:
    precision_kwargs = (
        {"plugins": [MixedPrecision("16-mixed", "cpu")]} if precision == "16-mixed" else {"precision": precision}
    )
    supported = grouped.grouped_mm_supported
    if loop:  # the kernel CUDA cannot use for fp32 weights under bf16-mixed
        grouped.grouped_mm_supported = lambda *args: False
    try:
        model, losses = _model(name), []
        model.on_train_batch_end = lambda outputs, *_: losses.append(float(outputs["loss"]))
        trainer = Trainer(
            accelerator="cpu", devices=WORLD, max_steps=STEPS, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0,
            strategy=MoEOverlapStrategy(ep=2, num_microbatches=MICRO, overlap=overlap, delay_wgrad=overlap),
            **precision_kwargs,
        )
        trainer.fit(model)
    finally:
        grouped.grouped_mm_supported = supported
    return losses, [p.detach().clone() for p in model.parameters()]


CASES = [
    (name, precision, loop)
    for name in ("qwen3_moe", "moegpt")
    for precision in ("bf16-mixed", "16-mixed")
    for loop in (True, False)
]


def _worker(rank: int, world: int) -> int:
    torch.set_num_threads(1)
    checked = 0
    for name, precision, loop in CASES:
        seq_losses, seq_params = _fit(name, precision, loop, overlap=False)
        losses, params = _fit(name, precision, loop, overlap=True)
        case = f"rank {rank} {name} {precision} {'loop' if loop else 'grouped'}"
        assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses))), (case, losses)
        assert losses == seq_losses, case
        for i, (a, b) in enumerate(zip(params, seq_params)):
            assert a.dtype == torch.float32, case  # mixed precision keeps fp32 parameters
            assert torch.equal(a, b), f"{case}: parameter {i} differs by {(a - b).abs().max()}"
        checked += 1
    return checked


def test_mixed_precision_trains_and_overlap_is_bitwise_equal():
    assert run_distributed(_worker, WORLD, timeout_s=300) == [len(CASES)] * WORLD
