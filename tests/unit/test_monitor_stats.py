"""Routing statistics on the device (``moe/stats.py``), the CUDA-event comm timer emulated on CPU, and the
monitor's histogram and errors, in one process."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_moe_overlap import MoEMonitor, OverlapTimeline
from lightning_moe_overlap.callbacks.monitor import _log_histograms
from lightning_moe_overlap.moe import MoELayer
from lightning_moe_overlap.moe.stats import RoutingStats, Summary, summarize
from lightning_moe_overlap.overlap.event_timer import EventCommTimer
from lightning_moe_overlap.overlap.runtime import CommRuntime
from tests.helpers.clock import TimedWork, VirtualClock

E, K = 4, 2


class FixedRouter(nn.Module):
    """Routes token t to experts ``table[t]`` (a known routing)."""

    def __init__(self, table: list[list[int]]) -> None:
        super().__init__()
        self.table = torch.tensor(table)
        self.top_k = K

    def forward(self, x: torch.Tensor):  # noqa: ANN201
        indices = self.table[: x.shape[0]]
        return torch.zeros(x.shape[0], E), torch.full(indices.shape, 0.5), indices


def layer_with(table: list[list[int]], capacity_factor: float | None = None) -> MoELayer:
    layer = MoELayer(8, 4, E, K, capacity_factor=capacity_factor, aux_loss_coeff=0.0)
    layer.gate = FixedRouter(table)
    return layer


def read(stats: RoutingStats, steps: int = 1) -> Summary:
    packed, layout = stats.pack(torch.device("cpu"))
    return summarize([b.name for b in stats.blocks], packed, layout, stats.bias_norms(torch.device("cpu")), steps=steps)


def test_known_routing_gives_known_statistics() -> None:
    table = [[0, 1], [0, 2], [0, 3], [0, 1], [1, 2], [0, 1]]  # counts [5, 4, 2, 1]
    model = nn.Sequential(layer_with(table, capacity_factor=1.0))
    stats = RoutingStats(model)
    model.train()
    model(torch.randn(6, 8))
    metrics = read(stats).metrics
    counts = [5, 4, 2, 1]
    mean = sum(counts) / E
    assert sum(counts) == 6 * K
    assert metrics["moe/0/tokens_per_expert_min"] == 1 and metrics["moe/0/tokens_per_expert_max"] == 5
    assert metrics["moe/0/imbalance"] == pytest.approx(5 / mean)
    assert metrics["moe/0/tokens_per_expert_cv"] == pytest.approx(
        math.sqrt(sum((c - mean) ** 2 for c in counts) / E) / mean
    )
    capacity = math.ceil(6 * K / E * 1.0)  # 3: expert 0 drops 2, expert 1 drops 1
    assert metrics["moe/0/dropped_fraction"] == pytest.approx(3 / 12)
    assert metrics["moe/dropped_fraction"] == pytest.approx(3 / 12)
    assert capacity == 3
    # Read once: the sums start again from zero.
    assert read(stats).metrics["moe/0/tokens_per_expert_max"] == 0


def test_eval_and_recompute_are_not_counted() -> None:
    model = nn.Sequential(layer_with([[0, 1]] * 4))
    stats = RoutingStats(model)
    model.eval()
    model(torch.randn(4, 8))
    model.train()
    x = torch.randn(4, 8, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
    out.sum().backward()  # the recompute runs the router again inside backward
    summary = read(stats)
    assert summary.tokens_per_expert["0"] == [4, 4, 0, 0]
    assert summary.tokens == 4


def test_router_losses_and_expert_bias_of_topk_router() -> None:
    torch.manual_seed(0)
    layer = MoELayer(8, 4, E, K, aux_loss_coeff=0.1, z_loss_coeff=0.01, score_function="sigmoid",
                     enable_expert_bias=True)
    with torch.no_grad():
        layer.gate.expert_bias.copy_(torch.tensor([3.0, 0.0, 4.0, 0.0]))
    model = nn.Sequential(layer)
    stats = RoutingStats(model)
    model.train()
    x = torch.randn(6, 8)
    model(x)
    aux, z = layer.gate.metrics["load_balancing_loss"], layer.gate.metrics["z_loss"]
    model(x)
    metrics = read(stats, steps=2).metrics
    assert metrics["moe/0/aux_loss"] == pytest.approx(float(aux))
    assert metrics["moe/0/z_loss"] == pytest.approx(float(z))
    assert metrics["moe/aux_loss"] == pytest.approx(float(aux))
    assert metrics["moe/0/expert_bias_norm"] == pytest.approx(5.0)
    assert "moe/0/dropped_fraction" not in metrics  # dropless and no what-if factor


def test_losses_a_block_never_computes_are_not_reported() -> None:
    """A router without a z-loss coefficient computes no z-loss, one without coefficients computes neither, and an
    HF-style router none: they report nothing rather than 0.0, and the totals only sum the blocks that compute."""
    torch.manual_seed(0)
    aux_only = MoELayer(8, 4, E, K, aux_loss_coeff=0.1, z_loss_coeff=0.0)
    neither = MoELayer(8, 4, E, K, aux_loss_coeff=0.0, z_loss_coeff=0.0)
    model = nn.Sequential(aux_only, neither, layer_with([[0, 1]] * 6))
    stats = RoutingStats(model)
    model.train()
    model(torch.randn(6, 8))
    aux = float(aux_only.gate.metrics["load_balancing_loss"])
    assert "z_loss" not in aux_only.gate.metrics and neither.gate.metrics == {}  # the oracle: what the routers made
    metrics = read(stats).metrics
    losses = {name: value for name, value in metrics.items() if name.endswith(("aux_loss", "z_loss"))}
    assert losses == {"moe/0/aux_loss": pytest.approx(aux), "moe/aux_loss": pytest.approx(aux)}
    assert "moe/1/tokens_per_expert_max" in metrics and "moe/2/tokens_per_expert_max" in metrics  # still monitored


def test_what_if_capacity_factor_of_a_dropless_block() -> None:
    model = nn.Sequential(layer_with([[0, 1]] * 4))
    stats = RoutingStats(model, capacity_factor=1.0)
    model.train()
    model(torch.randn(4, 8))
    # capacity ceil(4*2/4) = 2; experts 0 and 1 get 4 each: 2 + 2 of 8 dropped
    assert read(stats).metrics["moe/0/dropped_fraction"] == pytest.approx(0.5)


class HostEvent:
    """CPU emulation of ``torch.cuda.Event(enable_timing=True)``: the time of ``clock`` at ``record``."""

    clock: VirtualClock

    def __init__(self) -> None:
        self.at: float | None = None
        self.synchronized = 0

    def record(self) -> None:
        self.at = HostEvent.clock()

    def synchronize(self) -> None:
        self.synchronized += 1

    def elapsed_time(self, end: HostEvent) -> float:
        return (end.at - self.at) * 1e3


def test_event_timer_measures_like_the_host_timer_and_reads_once() -> None:
    HostEvent.clock = clock = VirtualClock()
    events: list[HostEvent] = []

    def make() -> HostEvent:
        events.append(HostEvent())
        return events[-1]

    runtime = CommRuntime()
    runtime.attach(timer := EventCommTimer(event_factory=make))
    for _ in range(2):
        work = TimedWork(clock, 0.03)
        runtime.handoff()
        clock.advance(0.01)  # compute under the collective
        runtime.wait(work)
    assert not any(e.synchronized for e in events)  # nothing read on the hot path
    times = timer.reset()
    assert times.waits == 2
    assert times.blocked_s == pytest.approx(2 * 0.02, abs=1e-9)  # each wait: the 30 ms less the 10 ms hidden
    assert times.in_flight_s == pytest.approx(2 * 0.03, abs=1e-9)
    assert timer.snapshot().waits == 0


class FakeExperiment:
    def __init__(self) -> None:
        self.raw: list[dict] = []

    def add_histogram_raw(self, tag, **kwargs) -> None:  # noqa: ANN001
        self.raw.append({"tag": tag, **kwargs})


def test_histogram_goes_to_loggers_that_take_histograms() -> None:
    tb, csv_like = SimpleNamespace(experiment=FakeExperiment()), SimpleNamespace(experiment=object())
    trainer = SimpleNamespace(loggers=[tb, csv_like])
    summary = Summary({}, {"layers.0.mlp": [5.0, 4.0, 2.0, 1.0]}, 6.0)
    _log_histograms(trainer, summary, step=3)
    (h,) = tb.experiment.raw
    assert h["tag"] == "moe/layers.0.mlp/tokens_per_expert" and h["global_step"] == 3
    assert h["bucket_counts"] == [5.0, 4.0, 2.0, 1.0] and h["num"] == 12.0
    assert h["sum"] == 0 * 5 + 1 * 4 + 2 * 2 + 3 * 1


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match=r"`MoEMonitor`: capacity_factor=0 must be None"):
        MoEMonitor(capacity_factor=0)
    with pytest.raises(ValueError, match=r"`OverlapTimeline\(step=-1\)`: the step must be an int >= 0"):
        OverlapTimeline(step=-1)


def test_timeline_png_without_matplotlib_is_refused(monkeypatch) -> None:  # noqa: ANN001
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(ImportError, match=r"needs matplotlib.*\[plot\]"):
        OverlapTimeline(step=1, png=True)
