"""Aux-loss-free balancing and ``MoEMonitor`` counts at ``pp > 1`` against a pp=1 run on the same in-order data.

4 gloo ranks, ``ep=2``: pp=2 (dp=2, M=4 micro-batches of one sample) under interleaved 1F1B, DualPipeV and 1F1B (its
paired order; DeepSeek-V3 only) with the overlap on, and pp=1 (dp=4, M=2, sequential), every step the same 8 samples
over all ranks. Oracle: per MoE layer, the expert bias after each step equals the pp=1 run's (and the pp=1 run's
equals one process of the unsplit model stepped by hand, bias updated from counts taken by a hook of the test); the
``MoEMonitor`` counts per layer equal the pp=1 run's. Models: HF DeepSeek-V3 (``e_score_correction_bias``) and
``MoEGPT`` with this package's ``TopKRouter(enable_expert_bias=True)``, both tiny with 4 layers.

Shapes: G samples per step over all ranks, S tokens per sample, E experts.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, Subset

from lightning_moe_overlap import MoEMonitor, MoEOverlapStrategy
from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.moe.router import TopKRouter
from tests.helpers import sgd
from tests.helpers.distributed import run_distributed

WORLD, EP, STEPS, G, S, E, VOCAB, LR, RATE = 4, 2, 2, 8, 8, 4, 32, 0.5, 1e-3
RUNS = (  # (name, pp, vpp, schedule, micro-batches, overlap)
    ("pp1", 1, 1, None, 2, False),
    ("interleaved", 2, 2, "interleaved_1f1b", 4, True),
    ("dualpipev", 2, 2, "dualpipev", 4, True),
    ("1f1b", 2, 1, "1f1b", 4, True),  # the paired order (pipeline/paired_1f1b.py)
)
BIAS = {"deepseek": "e_score_correction_bias", "gpt": "expert_bias"}
KINDS = {name: ("deepseek",) if name == "1f1b" else ("deepseek", "gpt") for name, *_ in RUNS}  # who runs each
CASES = [(kind, name) for name, *_ in RUNS[1:] for kind in KINDS[name]]  # (model, pp=2 schedule)


def tokens() -> torch.Tensor:
    """``[STEPS * G, S]``: the samples, in order."""
    return torch.randint(0, VOCAB, (STEPS * G, S), generator=torch.Generator().manual_seed(3))


class DeepSeekLM(sgd.SGDDeepSeek):
    """HF DeepSeek-V3, next-token loss, SGD (at this file's sizes)."""

    def __init__(self) -> None:
        super().__init__(vocab=VOCAB, experts=E)


class BiasGPT(MoEGPT):
    """``MoEGPT`` whose routers are sigmoid with the aux-loss-free expert bias, SGD."""

    def __init__(self) -> None:
        super().__init__(vocab_size=VOCAB, hidden_size=16, num_layers=4, num_heads=2, num_experts=E, top_k=2,
                         ffn_hidden_size=8, aux_loss_coeff=0.0)  # fmt: skip
        torch.manual_seed(1)
        for layer in self.layers:
            layer.mlp.gate = TopKRouter(16, E, 2, score_function="sigmoid", enable_expert_bias=True,
                                        expert_bias_update_rate=RATE)  # fmt: skip
            torch.nn.init.normal_(layer.mlp.gate.weight, std=0.5)

    def loss(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        return self._loss(tokens_BS)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def build(kind: str) -> LightningModule:
    return DeepSeekLM() if kind == "deepseek" else BiasGPT()


def routers(module: LightningModule) -> list[torch.nn.Module]:
    layers = module.model.model.layers if isinstance(module, DeepSeekLM) else module.layers
    return [layer.mlp.gate for layer in layers]


class Record(Callback):
    """After each step: every held layer's bias and the monitor's per-layer metrics."""

    def __init__(self, kind: str, monitor: MoEMonitor) -> None:
        self.kind, self.monitor = kind, monitor
        self.biases: list[dict[int, torch.Tensor]] = []
        self.metrics: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        held = {}
        for i, router in enumerate(routers(pl_module)):
            bias = getattr(router, BIAS[self.kind])
            if not bias.is_meta:
                held[i] = bias.detach().cpu().clone()
        self.biases.append(held)
        kept = ("tokens_per_expert", "imbalance", "bias_norm")  # not the timings, nor moe/microbatches
        self.metrics.append({k: v for k, v in self.monitor.last.items() if any(w in k for w in kept)})


def fit(kind: str, pp: int, vpp: int, schedule: str | None, micro: int, overlap: bool) -> dict:
    model = build(kind)
    monitor = MoEMonitor(histogram=False, progress_bar=False)
    record = Record(kind, monitor)
    extra = {} if pp == 1 else {"pp": pp, "vpp": vpp, "pipeline_schedule": schedule}
    strategy = MoEOverlapStrategy(ep=EP, num_microbatches=micro, overlap=overlap, timeout=120, **extra)
    trainer = Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=STEPS, logger=False, log_every_n_steps=1,
        use_distributed_sampler=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[monitor, record],
    )  # fmt: skip
    dp = strategy.dims.dp
    coords = strategy.dims.coords(trainer.global_rank)
    per = G // dp  # samples of one dp rank per step, in order
    index = [s * G + coords.dp * per + i for s in range(STEPS) for i in range(per)]
    trainer.fit(model, train_dataloaders=DataLoader(Subset(tokens(), index), batch_size=per))
    return {"biases": record.biases, "metrics": record.metrics, "pp": coords.pp}


def worker(rank: int, world: int) -> dict:
    torch.use_deterministic_algorithms(True)
    kinds = ("deepseek", "gpt")
    return {kind: {name: fit(kind, *run) for name, *run in RUNS if kind in KINDS[name]} for kind in kinds}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(worker, WORLD, timeout_s=300)


def one_process(kind: str) -> list[list[torch.Tensor]]:
    """The unsplit model in one process on the same samples: per step the mean loss over all G samples (SGD), then
    each router's bias moved by ``RATE * sign(mean - count)`` from counts taken by a hook of this test."""
    torch.use_deterministic_algorithms(True)
    module = build(kind)
    gates = routers(module)
    counts = [torch.zeros(E, dtype=torch.int64) for _ in gates]

    def counter(i: int):
        def hook(gate, args, output) -> None:
            counts[i] += torch.bincount(output[2].reshape(-1), minlength=E)

        return hook

    handles = [gate.register_forward_hook(counter(i)) for i, gate in enumerate(gates)]
    opt = module.configure_optimizers()
    data, biases = tokens(), []
    for step in range(STEPS):
        opt.zero_grad()
        for sample in data[step * G : (step + 1) * G]:
            (module.loss(sample[None]) / G).backward()
        opt.step()
        with torch.no_grad():
            for gate, c in zip(gates, counts):
                offset_E = c.double().mean() - c.double()
                getattr(gate, BIAS[kind]).add_(torch.sign(offset_E).float() * RATE)
                c.zero_()
        biases.append([getattr(gate, BIAS[kind]).detach().clone() for gate in gates])
    for handle in handles:
        handle.remove()
    return biases


@pytest.mark.parametrize("kind", ["deepseek", "gpt"])
def test_bias_at_pp1_equals_one_process(results: list[dict], kind: str) -> None:
    reference = one_process(kind)
    assert any(bool(b.ne(0).any()) for b in reference[-1])  # the biases moved (the comparison is not of zeros)
    for rank, runs in enumerate(results):
        got = runs[kind]["pp1"]["biases"]
        for step in range(STEPS):
            assert sorted(got[step]) == [0, 1, 2, 3], rank
            for layer, bias in got[step].items():
                assert torch.equal(bias, reference[step][layer]), (kind, rank, step, layer, bias, reference[step][layer])


@pytest.mark.parametrize(("kind", "schedule"), CASES)
def test_bias_at_pp2_equals_pp1_per_layer(results: list[dict], kind: str, schedule: str) -> None:
    reference = results[0][kind]["pp1"]["biases"]
    held_somewhere: set[int] = set()
    for rank, runs in enumerate(results):
        got = runs[kind][schedule]["biases"]
        assert len(got) == STEPS, rank
        for step in range(STEPS):
            assert got[step], (rank, step)  # every rank holds layers
            for layer, bias in got[step].items():
                assert torch.equal(bias, reference[step][layer]), (kind, schedule, rank, step, layer, bias)
                held_somewhere.add(layer)
    assert held_somewhere == set(range(4))


@pytest.mark.parametrize(("kind", "schedule"), CASES)
def test_monitor_counts_at_pp2_equal_pp1(results: list[dict], kind: str, schedule: str) -> None:
    reference = results[0][kind]["pp1"]["metrics"]
    assert any(k.startswith("moe/") and "layers.3" in k for k in reference[0]), reference[0]
    for rank, runs in enumerate(results):
        got = runs[kind][schedule]["metrics"]
        for step in range(STEPS):
            assert got[step].keys() == reference[step].keys(), (rank, step)
            for key, value in reference[step].items():
                assert got[step][key] == pytest.approx(value, rel=1e-12), (kind, schedule, rank, step, key)
