"""Host syncs of one MoE layer on two gloo ranks (ep=2): the documented count per dispatcher, and their order.

Each rank runs one forward + backward of a ``MoELayer`` under :class:`~tests.helpers.syncs.SyncCounter`, with
every collective issue and every hand-over logged in the same list as the syncs. Per rank: the sync count equals
docs/dispatchers.md's table, and no sync sits between issuing a collective and handing over.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_moe_overlap.moe import MoELayer, apply_expert_parallel
from lightning_moe_overlap.overlap import communicator
from lightning_moe_overlap.overlap.runtime import CommRuntime
from tests.helpers.distributed import run_distributed
from tests.helpers.syncs import SyncCounter
from tests.unit.test_host_syncs import DOCUMENTED, PausedFake


class LoggingRuntime(CommRuntime):
    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def handoff(self) -> None:
        self.log.append("handoff")
        super().handoff()


def _logged(log: list[str], name: str, fn):  # type: ignore[no-untyped-def]
    def issue(*args, **kwargs):  # type: ignore[no-untyped-def]
        log.append(f"issue:{name}")
        return fn(*args, **kwargs)

    return issue


def _worker(rank: int, world_size: int) -> dict:
    group = dist.new_group(list(range(world_size)))
    results = {}
    for dispatcher in ("alltoall", "allgather", "flex"):
        log: list[str] = []
        counter = SyncCounter(log)
        torch.manual_seed(0)
        layer = MoELayer(16, 8, 4, 2, capacity_factor=2.0, experts_impl="loop", aux_loss_coeff=1e-2)
        fake = PausedFake(group)
        fake.counter = counter
        knobs = {"deepep_buffer": fake} if dispatcher == "flex" else {}
        runtime = LoggingRuntime(log)
        apply_expert_parallel(layer, group, dispatcher=dispatcher, runtime=runtime, impl="loop", **knobs)
        torch.manual_seed(10 + rank)
        x = torch.randn(3 + 2 * rank, 16, requires_grad=True)  # uneven token counts
        originals = (dist.all_to_all_single, communicator._all_gather_single, communicator._reduce_scatter_single)
        dist.all_to_all_single = _logged(log, "all_to_all", originals[0])
        communicator._all_gather_single = _logged(log, "all_gather", originals[1])
        communicator._reduce_scatter_single = _logged(log, "reduce_scatter", originals[2])
        try:
            with counter:
                layer(x).square().sum().backward()
        finally:
            dist.all_to_all_single, communicator._all_gather_single, communicator._reduce_scatter_single = originals
        # After each issue, the next hand-over comes before the next sync.
        bad = []
        for i, entry in enumerate(log):
            if entry.startswith("issue:"):
                nxt = next((e for e in log[i + 1 :] if e == "handoff" or e.startswith("sync:")), None)
                if nxt != "handoff":
                    bad.append((i, entry, nxt))
        results[dispatcher] = {
            "counts": dict(counter.counts),
            "issues": sum(e.startswith("issue:") for e in log),
            "bad": bad,
        }
    return results


def test_host_syncs_per_dispatcher_on_two_ranks() -> None:
    for rank, results in enumerate(run_distributed(_worker, 2)):
        for dispatcher, got in results.items():
            assert got["counts"] == DOCUMENTED[dispatcher], (rank, dispatcher, got)
            assert got["issues"] > 0, (rank, dispatcher)  # collectives really ran
            assert got["bad"] == [], (rank, dispatcher, got["bad"])
