"""``delay_wgrad=True`` under ``Trainer(strategy=MoEOverlapStrategy(...))`` on 2 gloo ranks (ep=2, overlap on):
every expert weight-gradient GEMM runs from the runtime's queue, none inline, for this package's ``MoEGPT`` and a
tiny HF Qwen3-MoE, whose experts are ``DTensor``s over the ep mesh.

Oracle: a counter installed at test time around the wgrad GEMM (``moe/grouped.py``'s ``_wgrad``) and around what
the runtime queues; a GEMM counts as queued when it runs inside a queued closure, inline otherwise. The expected
number is the configuration's: steps x micro-batches x MoE layers x 2 projections per rank. Gradients and losses
are bitwise those of the ``delay_wgrad=False`` run on the same data.
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
from lightning_moe_overlap.moe import grouped
from lightning_moe_overlap.overlap.runtime import CommRuntime
from lightning_moe_overlap.parallel.dtensors import local
from tests.helpers.data import RandomTokens
from tests.helpers.distributed import run_distributed

WORLD, EP, MICRO, STEPS, BATCH, SEQ, LAYERS = 2, 2, 2, 2, 4, 9, 2
GEMMS_PER_RANK = STEPS * MICRO * LAYERS * 2  # fc1 and fc2 of every MoE layer, every micro-batch


class WgradCounter:
    """Counts the expert weight-gradient GEMMs, split by where they run: inside a queued closure or inline."""

    def __init__(self) -> None:
        self.queued = 0
        self.inline = 0
        self._lock = threading.Lock()
        self._running = threading.local()

    @contextmanager
    def installed(self) -> Iterator[WgradCounter]:
        original_wgrad, original_defer = grouped._wgrad, CommRuntime.defer_wgrad
        counter = self

        def counted_wgrad(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            with counter._lock:
                if getattr(counter._running, "queued", False):
                    counter.queued += 1
                else:
                    counter.inline += 1
            return original_wgrad(*args, **kwargs)

        def marked_defer(runtime: CommRuntime, fn: Callable[[], None]) -> bool:
            def from_queue() -> None:
                counter._running.queued = True
                try:
                    fn()
                finally:
                    counter._running.queued = False

            return original_defer(runtime, from_queue)

        grouped._wgrad, CommRuntime.defer_wgrad = counted_wgrad, marked_defer
        try:
            yield self
        finally:
            grouped._wgrad, CommRuntime.defer_wgrad = original_wgrad, original_defer


class Tokens(RandomTokens):
    def __init__(self, n: int = 32, vocab: int = 128) -> None:
        super().__init__(n, SEQ, vocab, seed=3)


def _model(kind: str) -> torch.nn.Module:
    if kind == "moegpt":
        return MoEGPT(vocab_size=128, hidden_size=32, num_layers=LAYERS, num_heads=4, num_experts=4, top_k=2,
                      ffn_hidden_size=16)
    return HFMoECausalLM("qwen3_moe", config_overrides={"num_hidden_layers": LAYERS})


def _fit(kind: str, delay: bool) -> dict:
    model = _model(kind)
    grads: list[list[torch.Tensor]] = []
    losses: list[torch.Tensor] = []
    model.on_before_optimizer_step = lambda optimizer: grads.append(
        [local(p.grad).clone() for p in model.parameters() if p.grad is not None]
    )
    model.on_train_batch_end = lambda outputs, *_: losses.append(outputs["loss"].detach().clone())
    trainer = Trainer(
        accelerator="cpu", devices=WORLD, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        strategy=MoEOverlapStrategy(ep=EP, num_microbatches=MICRO, overlap=True, delay_wgrad=delay),
    )
    with WgradCounter().installed() as counter:
        trainer.fit(model, train_dataloaders=DataLoader(Tokens(), batch_size=BATCH))
    return {"queued": counter.queued, "inline": counter.inline, "grads": grads, "losses": losses,
            "pending": trainer.strategy.runtime.pending_wgrad}


def _worker(rank: int, world: int) -> dict:
    return {(kind, delay): _fit(kind, delay) for kind in ("moegpt", "qwen3_moe") for delay in (False, True)}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_worker, WORLD, timeout_s=180)


@pytest.mark.parametrize("kind", ["moegpt", "qwen3_moe"])
def test_delay_wgrad_runs_every_expert_wgrad_from_the_queue(results, kind):
    for rank, result in enumerate(results):
        run = result[(kind, True)]
        assert (run["queued"], run["inline"]) == (GEMMS_PER_RANK, 0), f"rank {rank}"
        assert run["pending"] == 0, f"rank {rank}"  # nothing left in the queue after the step


@pytest.mark.parametrize("kind", ["moegpt", "qwen3_moe"])
def test_without_delay_wgrad_every_expert_wgrad_runs_inline(results, kind):
    for rank, result in enumerate(results):
        run = result[(kind, False)]
        assert (run["queued"], run["inline"]) == (0, GEMMS_PER_RANK), f"rank {rank}"


@pytest.mark.parametrize("kind", ["moegpt", "qwen3_moe"])
def test_delay_wgrad_gradients_and_losses_bitwise_equal_to_inline(results, kind):
    for rank, result in enumerate(results):
        inline, delayed = result[(kind, False)], result[(kind, True)]
        assert len(delayed["grads"]) == len(inline["grads"]) == STEPS, f"rank {rank}"
        for step, (got, want) in enumerate(zip(delayed["grads"], inline["grads"], strict=True)):
            assert len(got) == len(want), f"rank {rank} step {step}"
            assert all(torch.equal(a, b) for a, b in zip(got, want)), f"rank {rank} step {step}"
        assert len(delayed["losses"]) == STEPS
        assert all(torch.equal(a, b) for a, b in zip(delayed["losses"], inline["losses"])), f"rank {rank}"
        assert not torch.equal(inline["losses"][0], inline["losses"][-1])  # the steps train (not constants)
