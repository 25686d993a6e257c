"""Where the early reductions of ``overlap_grad_reduce`` are issued (``parallel/grad_reduce.py``): on the backward's
thread where a collective launches onto a stream (NCCL), on a lane of their own where it blocks the host (gloo).

2 gloo ranks, ep=2, ``MoEGPT``, ``shard="full"``, overlapped, 3 micro-batches. The backward-thread mode is what CUDA
takes; here it is forced (``grad_reduce.blocks_the_host`` patched), which gloo allows because the order is the same on
every rank: a rank blocked in a reduce-scatter waits only for a peer on its way to the same one.

Oracles, none of them the code under test: a record of every all-to-all and reduce-scatter each rank submitted
(``torch.distributed`` wrapped), with the submitting thread, between the strategy's ``before_last_backward`` and
``end_step``; the other rank's record; the lane mode's optimizer shards.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from torch.distributed.tensor import DTensor

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.parallel import grad_reduce
from lightning_moe_overlap.parallelize import sharding
from tests.distributed.test_overlap_grad_reduce import _model  # the same model and data as the reduction's tests
from tests.helpers.distributed import run_distributed

WORLD, EP, STEPS, MICRO = 2, 2, 2, 3
LANE = "moe-overlap-grad-reduce"  # the reduction lane's thread name


class _Collectives:
    """Every all-to-all and reduce-scatter submitted, as ``(thread name, op, group ranks)``, and the marks
    ``("mark", "before_last_backward" | "end_step", ())`` around each step's last backward."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[tuple[str, str, tuple[int, ...]]] = []
        for op in ("all_to_all_single", "reduce_scatter_single"):
            monkeypatch.setattr(dist, op, self._wrap(op, getattr(dist, op)))
        for hook in ("before_last_backward", "end_step"):
            monkeypatch.setattr(sharding.ShardedModel, hook, self._mark(hook, getattr(sharding.ShardedModel, hook)))

    def _wrap(self, op, call):
        def recorded(*args, **kwargs):
            group = kwargs.get("group")
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
            self.log.append((threading.current_thread().name, op, ranks))
            return call(*args, **kwargs)

        return recorded

    def _mark(self, name, method):
        def marked(model, *args, **kwargs):
            self.log.append(("mark", name, ()))
            return method(model, *args, **kwargs)

        return marked

    def last_backwards(self) -> list[list[tuple[str, str, tuple[int, ...]]]]:
        """Each step's submissions between ``before_last_backward`` and ``end_step``."""
        windows, current = [], None
        for entry in self.log:
            if entry[:2] == ("mark", "before_last_backward"):
                current = []
            elif entry[:2] == ("mark", "end_step"):
                if current is not None:
                    windows.append(current)
                current = None
            elif current is not None:
                current.append(entry)
        return windows


def _fit(on_backward_thread: bool) -> dict:
    with pytest.MonkeyPatch.context() as monkeypatch:
        if on_backward_thread:
            monkeypatch.setattr(grad_reduce, "blocks_the_host", lambda device: False)
        record = _Collectives(monkeypatch)
        trainer = Trainer(
            accelerator="cpu", devices=WORLD, max_steps=STEPS, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
            strategy=MoEOverlapStrategy(ep=EP, num_microbatches=MICRO, shard="full", overlap_grad_reduce=True),
        )  # fmt: skip
        trainer.fit(_model())
    params = [p for g in trainer.optimizers[0].param_groups for p in g["params"]]
    return {
        "shards": [(p.to_local() if isinstance(p, DTensor) else p).detach().clone() for p in params],
        "windows": record.last_backwards(),
    }


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    return {"lane": _fit(False), "backward": _fit(True)}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_worker, WORLD, timeout_s=240)


def test_on_the_backward_thread_one_thread_submits_both_kinds_in_one_order_on_every_rank(results):
    per_rank = [r["backward"]["windows"] for r in results]
    assert len(per_rank[0]) == STEPS
    for step, window in enumerate(per_rank[0]):
        ops = [op for _, op, _ in window]
        scatters = [i for i, op in enumerate(ops) if op == "reduce_scatter_single"]
        exchanges = [i for i, op in enumerate(ops) if op == "all_to_all_single"]
        assert scatters and exchanges, window
        assert scatters[0] < exchanges[-1], "a unit is reduced while the last backward still exchanges tokens"
        assert len({thread for thread, _, _ in window}) == 1, f"step {step}: submitted from {set(window)}"
        assert LANE not in {thread for thread, _, _ in window}
        # the other rank submitted the same collectives to the same groups in the same order
        assert [(op, ranks) for _, op, ranks in window] == [(op, ranks) for _, op, ranks in per_rank[1][step]]


def test_on_the_lane_the_reductions_come_from_their_own_thread(results):
    for per_rank in results:
        for window in per_rank["lane"]["windows"]:
            threads = {
                op: {t for t, o, _ in window if o == op} for op in ("reduce_scatter_single", "all_to_all_single")
            }
            assert threads["reduce_scatter_single"] == {LANE}, window
            assert LANE not in threads["all_to_all_single"]


def test_both_places_give_bitwise_the_same_shards(results):
    for per_rank in results:
        lane, backward = per_rank["lane"]["shards"], per_rank["backward"]["shards"]
        assert len(lane) == len(backward)
        for a, b in zip(lane, backward, strict=True):
            assert torch.equal(a, b)
