"""``MoEOverlapStrategy(fp8=...)`` on 2 gloo ranks (ep=2, 2 micro-batches): the overlapped FP8 step is bitwise the
sequential one (``rowwise`` and ``mxfp8``), ``delay_wgrad`` still queues every FP8 expert weight gradient, the
tokens are dispatched in FP8 (in high precision with ``mxfp8``), and a tiny HF Qwen3-MoE trains in FP8 close to its
float32 run.

Oracles: the ``overlap=False`` run of the same configuration (bitwise); counters installed at test time around the
FP8 wgrad GEMM (``fp8/experts_kernel.py``'s ``fp8_wgrad``: queued when it runs inside a closure the runtime queued) and
around the FP8 token exchange (``moe/dispatch/alltoall.py``'s ``float8_all_to_all``), whose expected counts are the
configuration's (steps x micro-batches x MoE layers, x 2 projections for the GEMMs); the float32 run's loss.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.demo_hf import HFMoECausalLM
from lightning_moe_overlap.fp8 import experts_kernel as fp8_experts
from lightning_moe_overlap.fp8.apply import has_fp8_kernel
from lightning_moe_overlap.moe.dispatch import alltoall
from lightning_moe_overlap.overlap.runtime import CommRuntime
from lightning_moe_overlap.parallel.dtensors import local
from tests.helpers.data import RandomTokens
from tests.helpers.distributed import run_distributed

WORLD, EP, MICRO, STEPS, BATCH, SEQ, LAYERS = 2, 2, 2, 2, 4, 9, 2
HF_STEPS = 6
PER_RANK = STEPS * MICRO * LAYERS  # MoE layer forwards per rank


class Counters:
    """FP8 wgrad GEMMs (queued / inline) and FP8 token exchanges, counted where the package calls them."""

    def __init__(self) -> None:
        self.queued = self.inline = self.fp8_dispatches = 0
        self._lock = threading.Lock()
        self._running = threading.local()

    @contextmanager
    def installed(self) -> Iterator[Counters]:
        wgrad, defer, exchange = fp8_experts.fp8_wgrad, CommRuntime.defer_wgrad, alltoall.float8_all_to_all
        counters = self

        def counted_wgrad(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            with counters._lock:
                if getattr(counters._running, "queued", False):
                    counters.queued += 1
                else:
                    counters.inline += 1
            return wgrad(*args, **kwargs)

        def marked_defer(runtime: CommRuntime, fn: Callable[[], None]) -> bool:
            def from_queue() -> None:
                counters._running.queued = True
                try:
                    fn()
                finally:
                    counters._running.queued = False

            return defer(runtime, from_queue)

        def counted_exchange(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            with counters._lock:
                counters.fp8_dispatches += 1
            return exchange(*args, **kwargs)

        fp8_experts.fp8_wgrad, CommRuntime.defer_wgrad = counted_wgrad, marked_defer
        alltoall.float8_all_to_all = counted_exchange
        try:
            yield self
        finally:
            fp8_experts.fp8_wgrad, CommRuntime.defer_wgrad, alltoall.float8_all_to_all = wgrad, defer, exchange


class Tokens(RandomTokens):
    def __init__(self, n: int, vocab: int = 128) -> None:
        super().__init__(n, SEQ, vocab, seed=3)


def _model(kind: str) -> torch.nn.Module:
    if kind == "moegpt":
        return MoEGPT(vocab_size=128, hidden_size=32, num_layers=LAYERS, num_heads=4, num_experts=4, top_k=2,
                      ffn_hidden_size=32)  # fmt: skip
    return HFMoECausalLM("qwen3_moe", config_overrides={"num_hidden_layers": LAYERS})


def _fit(kind: str, fp8: str | None, *, overlap: bool = True, delay: bool = False, steps: int = STEPS) -> dict:
    torch.manual_seed(0)
    model = _model(kind)
    grads: list[list[torch.Tensor]] = []
    losses: list[torch.Tensor] = []
    model.on_before_optimizer_step = lambda optimizer: grads.append(
        [local(p.grad).clone() for p in model.parameters() if p.grad is not None]
    )
    model.on_train_batch_end = lambda outputs, *_: losses.append(outputs["loss"].detach().clone())
    strategy = MoEOverlapStrategy(ep=EP, num_microbatches=MICRO, overlap=overlap, delay_wgrad=delay, fp8=fp8)
    trainer = Trainer(
        accelerator="cpu", devices=WORLD, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        strategy=strategy,
    )  # fmt: skip
    with Counters().installed() as counters:
        trainer.fit(model, train_dataloaders=DataLoader(Tokens(steps * BATCH), batch_size=BATCH))
    report = strategy.fp8_report
    return {
        "queued": counters.queued, "inline": counters.inline, "fp8_dispatches": counters.fp8_dispatches,
        "grads": grads, "losses": losses, "pending": trainer.strategy.runtime.pending_wgrad,
        "fp8_experts": sum(has_fp8_kernel(m) for m in model.modules()),
        "report": None if report is None else (len(report.linears), len(report.experts)),
    }  # fmt: skip


def _worker(rank: int, world: int) -> dict:
    return {
        "overlapped": _fit("moegpt", "rowwise"),
        "sequential": _fit("moegpt", "rowwise", overlap=False),
        "mx_overlapped": _fit("moegpt", "mxfp8"),
        "mx_sequential": _fit("moegpt", "mxfp8", overlap=False),
        "delayed": _fit("moegpt", "tensorwise", delay=True),
        "inline": _fit("moegpt", "tensorwise"),
        "hf_fp8": _fit("qwen3_moe", "rowwise", steps=HF_STEPS),
        "hf_fp32": _fit("qwen3_moe", None, steps=HF_STEPS),
    }


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_worker, WORLD, timeout_s=240)


def _bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_fp8_converts_the_model_and_dispatches_every_layer_in_fp8(results):
    for rank, result in enumerate(results):
        run = result["overlapped"]
        # MoEGPT: qkv and proj of each layer (the head and the routers stay in high precision), every experts module
        assert run["report"] == (2 * LAYERS, LAYERS) and run["fp8_experts"] == LAYERS, f"rank {rank}"
        assert run["fp8_dispatches"] == PER_RANK, f"rank {rank}"
        assert result["hf_fp32"]["fp8_dispatches"] == 0 and result["hf_fp32"]["report"] is None


def test_overlapped_fp8_step_is_bitwise_the_sequential_one(results):
    for rank, result in enumerate(results):
        overlapped, sequential = result["overlapped"], result["sequential"]
        assert len(overlapped["grads"]) == STEPS, f"rank {rank}"
        for step, (got, want) in enumerate(zip(overlapped["grads"], sequential["grads"], strict=True)):
            assert _bitwise(got, want), f"rank {rank} step {step}"
        assert _bitwise(overlapped["losses"], sequential["losses"]), f"rank {rank}"


def test_mxfp8_overlapped_step_is_bitwise_the_sequential_one_with_high_precision_dispatch(results):
    """``fp8="mxfp8"``: torchao's MX linears (micro-batches of 2 x 9 = 18 token rows, padded to 32 for their weight
    gradients) and the experts' block-scaled kernel; the rows are dispatched in high precision."""
    for rank, result in enumerate(results):
        overlapped, sequential = result["mx_overlapped"], result["mx_sequential"]
        assert overlapped["report"] == (2 * LAYERS, LAYERS) and overlapped["fp8_experts"] == LAYERS, f"rank {rank}"
        assert overlapped["fp8_dispatches"] == 0 and overlapped["inline"] == 2 * PER_RANK, f"rank {rank}"
        assert len(overlapped["grads"]) == STEPS, f"rank {rank}"
        for step, (got, want) in enumerate(zip(overlapped["grads"], sequential["grads"], strict=True)):
            assert _bitwise(got, want), f"rank {rank} step {step}"
        assert _bitwise(overlapped["losses"], sequential["losses"]), f"rank {rank}"
        assert not _bitwise(overlapped["losses"], result["overlapped"]["losses"])  # not the rowwise run


def test_delay_wgrad_queues_every_fp8_expert_wgrad_with_the_inline_gradients(results):
    for rank, result in enumerate(results):
        delayed, inline = result["delayed"], result["inline"]
        assert (delayed["queued"], delayed["inline"]) == (2 * PER_RANK, 0), f"rank {rank}"
        assert (inline["queued"], inline["inline"]) == (0, 2 * PER_RANK), f"rank {rank}"
        assert delayed["pending"] == 0
        for step, (got, want) in enumerate(zip(delayed["grads"], inline["grads"], strict=True)):
            assert _bitwise(got, want), f"rank {rank} step {step}"


def test_hf_qwen3_moe_trains_in_fp8_within_3_percent_of_float32(results):
    for rank, result in enumerate(results):
        fp8, fp32 = result["hf_fp8"], result["hf_fp32"]
        assert fp8["report"] is not None and fp8["report"][1] == LAYERS and fp8["fp8_dispatches"] > 0
        end, end_ref = fp8["losses"][-1].item(), fp32["losses"][-1].item()
        assert end < fp8["losses"][0].item()  # it trains
        assert abs(end - end_ref) <= 0.03 * end_ref, (rank, end, end_ref)
        assert end != end_ref
