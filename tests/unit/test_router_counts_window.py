"""Token counters under the overlap engine with recompute: a forward of the other context that routes through a
layer while that layer's recomputation waits at a comm point keeps its counts.

Schedule (one process, the loopback comm points still hand over): ``F0, (F1|B0), B1`` over two MoE decoder layers
with full recompute of each layer. ``B0`` recomputes layer 1 and hands over at the recomputation's all-to-all;
``F1`` then routes through layer 1 before that recomputation ends (the test checks it happens). Oracle: a counter
of what ran, the test's own ``bincount`` of the routing of every training forward, and a run without recompute.

Shapes: T tokens of a micro-batch, K top-k, E experts.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from lightning_moe_overlap._compat import torch as torch_compat
from lightning_moe_overlap.callbacks import SelectiveRecompute
from lightning_moe_overlap.demo import MoEDecoderLayer
from lightning_moe_overlap.moe.ep import apply_expert_parallel
from lightning_moe_overlap.moe.layer import MoELayer
from lightning_moe_overlap.moe.router import not_counted
from lightning_moe_overlap.moe.stats import RoutingStats
from lightning_moe_overlap.overlap.engine import OverlapEngine
from lightning_moe_overlap.overlap.runtime import CommRuntime

E, D, MICRO = 4, 16, 2


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def model() -> nn.Sequential:
    """A dense layer (no comm point: a forward runs through it without handing over), then an MoE decoder layer."""
    torch.manual_seed(0)
    moe = MoELayer(D, 8, E, 2, score_function="sigmoid", enable_expert_bias=True)
    net = nn.Sequential(nn.Linear(D, D), MoEDecoderLayer(D, 2, moe))
    apply_expert_parallel(net, None, runtime=CommRuntime())
    return net


class Trace:
    """Per router: the test's own counts of training forwards; per layer: when its recomputation starts and ends."""

    def __init__(self, net: nn.Sequential) -> None:
        self.counts = {1: torch.zeros(E, dtype=torch.int64)}
        self.events: list[tuple[str, int]] = []
        self.handles = []
        for i, layer in [(1, net[1])]:
            self.handles += [
                layer.mlp.gate.register_forward_hook(self._routed(i)),
                layer.mlp.register_forward_hook(lambda m, a, o, i=i: self._mark("end", i)),  # after the combine
            ]

    @staticmethod
    def in_backward() -> bool:
        return torch_compat.current_graph_task_id() != -1

    def _mark(self, what: str, layer: int) -> None:
        if self.in_backward():
            self.events.append((what, layer))

    def _routed(self, layer: int):
        def hook(module, args, output) -> None:
            if self.in_backward():  # the recomputation has reached the router: its all-to-alls follow
                self.events.append(("start", layer))
                return
            self.events.append(("forward", layer))
            self.counts[layer] += torch.bincount(output[2].reshape(-1), minlength=E)

        return hook

    def forward_inside_recompute(self, layer: int) -> bool:
        open_ = False
        for what, i in self.events:
            if i == layer and what in ("start", "end"):
                open_ = what == "start"
            elif i == layer and what == "forward" and open_:
                return True
        return False


def run(recompute: bool, overlap: bool = True) -> tuple[nn.Sequential, Trace, RoutingStats]:
    net = model()
    stats = RoutingStats(net)
    callback = SelectiveRecompute(granularity="full", num_layers=1) if recompute else None
    if callback is not None:
        callback.apply(net)
    trace = Trace(net)
    runtime = net[1].mlp.experts.runtime
    engine = OverlapEngine(runtime, overlap=overlap, timeout_s=30)
    x = torch.randn(MICRO, 1, 6, D, generator=torch.Generator().manual_seed(1))
    engine.run(lambda i: net(x[i]).square().mean(), lambda i, loss: (loss / MICRO).backward(), MICRO)
    if callback is not None:
        callback.remove()
    return net, trace, stats


def test_forward_inside_a_recomputation_keeps_its_counts() -> None:
    net, trace, stats = run(recompute=True)
    assert trace.forward_inside_recompute(1), trace.events  # the schedule puts F1 through layer 1 in the window
    plain, _, plain_stats = run(recompute=False)
    counts = trace.counts[1]
    assert int(counts.sum()) == MICRO * 6 * 2  # every training forward once, none in backward
    assert torch.equal(net[1].mlp.gate.local_tokens_per_expert, counts)
    assert torch.equal(plain[1].mlp.gate.local_tokens_per_expert, counts)
    assert torch.equal(stats.blocks[0].counts_E, counts)  # MoEMonitor's counts
    assert torch.equal(plain_stats.blocks[0].counts_E, counts)


def test_not_counted_pauses_only_its_own_thread() -> None:
    net = model()
    x = torch.randn(6, D)
    gate = net[1].mlp.gate
    with not_counted():
        gate(x)
        assert int(gate.local_tokens_per_expert.sum()) == 0
        other = threading.Thread(target=gate, args=(x,))  # another context: counts
        other.start()
        other.join()
    assert int(gate.local_tokens_per_expert.sum()) == 6 * 2
    gate(x)
    assert int(gate.local_tokens_per_expert.sum()) == 2 * 6 * 2
