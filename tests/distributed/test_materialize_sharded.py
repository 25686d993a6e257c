"""With ``shard="optimizer" | "full"`` the dense modules built on meta get their values after ``fully_shard``, one
module at a time: no rank ever holds the dense part of its model (``pp = 1``) or stage (``pp > 1``) whole.

Oracles, on 2 gloo ranks (pp=1, dp=2, ep=2; and with ``fp8="tensorwise"``) and 4 (pp=2, vpp=2, dp=2, ep=2; and
tp=2, dp=2), ``MoEGPT`` built on meta with a large vocabulary (the embedding and head are most of the dense bytes):
- what the model holds while it is initialised, observed from its own ``init_module`` hook: at each call, the dense
  bytes allocated on this rank (local shards, whole plain tensors, nothing on meta), counted from the model's
  parameters; at most the rank's dense share plus the one module being initialised, and below the dense part whole
  (``shard="none"``, which replicates, holds it whole: the same count reaches it there);
- the values: the consolidated state after setup bitwise equal to the ``shard="none"`` run's (whose dense modules are
  built whole, as before), which the pipeline and sharding tests already hold to one process's seeded init.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo import MoEGPT
from tests.distributed.test_pipeline_sharded import _trainer
from tests.helpers.distributed import run_distributed

GPT = {"vocab_size": 512, "hidden_size": 32, "num_layers": 4, "num_heads": 2, "num_experts": 4, "top_k": 2,
       "ffn_hidden_size": 16}  # fmt: skip
RUNS = (  # (name, processes, layout): the steps between the deferral and the fill are tp, fp8, precision, fully_shard
    ("pp1", 2, {}),
    ("pp2", 4, {"pp": 2, "vpp": 2}),
    ("tp2", 4, {"tp": 2}),
    ("fp8", 2, {"fp8": "tensorwise"}),  # at shard="full": the weights all-gathered in float8 (torchao's wrapper)
)


def _dense_bytes(module: nn.Module, experts: set[int]) -> int:
    """Bytes of the dense parameters this rank has allocated (a DTensor's local shard; nothing on meta)."""
    total = 0
    for p in {id(p): p for p in module.parameters()}.values():
        data = p.to_local() if isinstance(p, DTensor) else p
        if id(p) not in experts and not data.is_meta:
            total += data.numel() * data.element_size()
    return total


class Observed(MoEGPT):
    """``MoEGPT`` built on the meta device (as ``configure_model`` builds under the strategy), whose init hook
    records, at each call, the dense bytes allocated and the module's own bytes."""

    def __init__(self) -> None:
        with torch.device("meta"):
            super().__init__(**GPT)
        self.seen: list[tuple[int, int]] = []

    def init_module(self, module: nn.Module) -> None:
        experts = {id(p) for n, p in self.named_parameters() if ".experts." in f".{n}"}
        own = sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
        if own and not any(id(p) in experts for p in module.parameters(recurse=False)):
            self.seen.append((_dense_bytes(self, experts), own))
        super().init_module(module)


def worker(rank: int, world: int, root: Path, names: tuple[str, ...]) -> dict:
    out: dict = {}
    for name, procs, layout in RUNS:
        if procs != world or name not in names:
            continue
        for shard in ("none", "full", "optimizer"):
            torch.manual_seed(0)
            model = Observed()
            micro = 2 * layout.get("pp", 1)
            strategy = MoEOverlapStrategy(ep=2, shard=shard, num_microbatches=micro, timeout=120, **layout)
            trainer = _trainer(strategy, [], world, max_steps=0)
            trainer.fit(model, train_dataloaders=[torch.zeros(2, 9, dtype=torch.long)])
            experts = {id(p) for n, p in model.named_parameters() if ".experts." in f".{n}"}
            whole = sum(
                int(torch.Size(p.shape).numel()) * p.element_size()
                for n, p in model.named_parameters() if id(p) not in experts
            )  # fmt: skip
            out[(name, shard)] = {
                "seen": model.seen, "full": strategy.full_state_dict(), "whole": whole,
                "held": _dense_bytes(model, experts),
            }  # fmt: skip
    return out


LONG = ("tp2", "fp8")  # `python -m pytest -m long`


def _spawn(root: Path, names: tuple[str, ...]) -> dict[int, list[dict]]:
    counts = sorted({procs for name, procs, _ in RUNS if name in names})
    return {procs: run_distributed(worker, procs, root, names, timeout_s=300) for procs in counts}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict]]:
    return _spawn(tmp_path_factory.mktemp("materialize"), tuple(n for n, _, _ in RUNS if n not in LONG))


@pytest.fixture(scope="module")
def long_results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict]]:
    return _spawn(tmp_path_factory.mktemp("materialize_long"), LONG)


def _layouts() -> list:
    return [
        pytest.param(name, procs, marks=pytest.mark.long) if name in LONG else pytest.param(name, procs)
        for name, procs, _ in RUNS
    ]


def _of(request: pytest.FixtureRequest, name: str) -> dict[int, list[dict]]:
    return request.getfixturevalue("long_results" if name in LONG else "results")


@pytest.mark.parametrize("name,procs", _layouts())
@pytest.mark.parametrize("shard", ["full", "optimizer"])
def test_no_rank_holds_the_dense_part_whole_while_it_is_initialised(request, name, procs, shard) -> None:
    for rank, found in enumerate(_of(request, name)[procs]):
        run, replicated = found[(name, shard)], found[(name, "none")]
        stage_whole = max(b for b, _ in replicated["seen"])  # the replicated run holds its dense part whole
        assert stage_whole >= replicated["held"] > 0, (rank, stage_whole, replicated["held"])
        assert run["seen"], rank
        largest = max(own for _, own in run["seen"])
        peak = max(b for b, _ in run["seen"])
        assert peak <= run["held"] + largest, (rank, peak, run["held"], largest)
        assert peak < stage_whole, (rank, peak, stage_whole)


@pytest.mark.parametrize("name,procs", _layouts())
def test_the_values_are_the_whole_builds(request, name, procs) -> None:
    results = _of(request, name)
    reference = results[procs][0][(name, "none")]["full"]
    for shard in ("full", "optimizer"):
        state = results[procs][0][(name, shard)]["full"]
        assert state.keys() == reference.keys()
        assert [k for k in state if not torch.equal(state[k], reference[k])] == [], shard
