"""``MoEOverlapStrategy(overlap_grad_reduce=True)`` on 2 gloo ranks, ep=2, ``MoEGPT``, 3 micro-batches, AdamW,
clipping by the global norm: each FSDP unit reduced during the last backward (``parallel/grad_reduce.py``).

Oracles: the optimizer's parameter shards after 3 steps are bitwise those of the end-of-step reduction (the flag
off), for ``shard="optimizer"`` and ``"full"``, with the overlapped and the sequential schedule, and with delayed
expert weight gradients (whose experts units wait for the end of the step); a record of the early reduction's
events next to the test's own hook on the first layer's input gradient shows every unit of the second layer issued
before the backward reached the first layer, the root (which holds the embedding) after it, each unit once per step
and none before the last backward.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo import MoEGPT
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.long  # a variant matrix: `pytest -m long` (docs/benchmarks.md, Tests)

WORLD, EP, STEPS, BATCH, MICRO, VOCAB = 2, 2, 3, 6, 3, 64


def _model() -> MoEGPT:
    torch.manual_seed(0)
    model = MoEGPT(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_experts=4, top_k=2,
                   ffn_hidden_size=16, aux_loss_coeff=0.0, lr=1e-2)  # fmt: skip
    data = torch.randint(0, VOCAB, (WORLD * BATCH * STEPS, 8), generator=torch.Generator().manual_seed(5))
    model.train_dataloader = lambda: DataLoader(data, batch_size=BATCH)
    return model


class _Record(Callback):
    """Every step's events: ``("step", i)``, the early reduction's ``(event, unit)`` and, from the test's own
    tensor hook, ``("input-grad", "layers.0")`` each time a backward computed the first layer's input gradient."""

    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []

    def on_train_start(self, trainer, pl_module) -> None:
        trainer.strategy.prepared.sharded.observe_reduction(lambda event, unit: self.events.append((event, unit)))

        def mark(module, args) -> None:
            if torch.is_grad_enabled() and args[0].requires_grad:
                args[0].register_hook(lambda grad: self.events.append(("input-grad", "layers.0")))

        pl_module.layers[0].register_forward_pre_hook(mark)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.events.append(("step", batch_idx))


def _fit(shard: str, overlap: bool, early: bool, delay_wgrad: bool = False) -> dict:
    model = _model()
    record = _Record()
    trainer = Trainer(
        accelerator="cpu", devices=WORLD, max_steps=STEPS, gradient_clip_val=0.5, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[record],
        strategy=MoEOverlapStrategy(ep=EP, num_microbatches=MICRO, overlap=overlap, shard=shard,
                                    delay_wgrad=delay_wgrad, overlap_grad_reduce=early),
    )  # fmt: skip
    trainer.fit(model)
    params = [p for g in trainer.optimizers[0].param_groups for p in g["params"]]
    units = [name for name, _ in trainer.strategy.prepared.sharded.named_units()]
    return {
        "shards": [(p.to_local() if isinstance(p, DTensor) else p).detach().clone() for p in params],
        "events": record.events,
        "units": units,
    }


CASES = [(shard, overlap) for shard in ("optimizer", "full") for overlap in (True, False)]


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    results = {}
    for shard, overlap in CASES:
        for early in (False, True):
            results[(shard, overlap, early)] = _fit(shard, overlap, early)
    for early in (False, True):
        results[("full", True, early, "delay_wgrad")] = _fit("full", True, early, delay_wgrad=True)
    return results


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_worker, WORLD, timeout_s=360)


@pytest.mark.parametrize(("shard", "overlap"), CASES)
def test_early_reduction_is_bitwise_equal_to_the_end_of_step_one(results, shard, overlap):
    for rank, per_rank in enumerate(results):
        late, early = per_rank[(shard, overlap, False)]["shards"], per_rank[(shard, overlap, True)]["shards"]
        assert len(late) == len(early)
        for i, (a, b) in enumerate(zip(late, early)):
            assert torch.equal(a, b), f"rank {rank}, parameter {i}: differs with overlap_grad_reduce"


def test_early_reduction_with_delayed_expert_weight_gradients_is_bitwise_equal(results):
    for per_rank in results:
        late = per_rank[("full", True, False, "delay_wgrad")]["shards"]
        early = per_rank[("full", True, True, "delay_wgrad")]["shards"]
        assert all(torch.equal(a, b) for a, b in zip(late, early))


def test_with_delayed_expert_weight_gradients_only_the_experts_wait_for_the_end(results):
    """Autograd calls a parameter's hook with no gradient when the weight gradient is deferred, so an experts unit
    armed like the others could be reduced before its deferred gradients land (a race: the bitwise test above failed
    now and then). Those units are left out of the early order; the dense layers are still reduced early."""
    for per_rank in results:
        run = per_rank[("full", True, True, "delay_wgrad")]
        for step in _steps(run["events"]):
            issued = [unit for event, unit in step if event == "issue"]
            assert not [u for u in issued if u.endswith("experts")], issued
            assert "layers.1" in issued and "layers.0" in issued, issued
            last_backward_reached_layer0 = [i for i, (event, _) in enumerate(step) if event == "input-grad"][-1]
            assert step.index(("issue", "layers.1")) < last_backward_reached_layer0, step


def _steps(events: list[tuple[str, object]]) -> list[list[tuple[str, object]]]:
    steps: list[list[tuple[str, object]]] = []
    for event in events:
        if event[0] == "step":
            steps.append([])
        else:
            steps[-1].append(event)
    return steps


@pytest.mark.parametrize(("shard", "overlap"), CASES)
def test_units_are_reduced_during_the_last_backward(results, shard, overlap):
    for per_rank in results:
        run = per_rank[(shard, overlap, True)]
        units = run["units"]
        # the root, each layer and each layer's experts are units of their own
        assert units[0] == "" and "layers.0" in units and "layers.1" in units
        experts = [u for u in units if u.startswith("layers.1.") and u.endswith("experts")]
        assert len(experts) == 1, units
        assert len(_steps(run["events"])) == STEPS
        for step in _steps(run["events"]):
            issued = [unit for event, unit in step if event == "issue"]
            assert sorted(issued) == sorted(units), "each unit issued once per step"
            assert sorted(u for e, u in step if e == "reduced") == sorted(units)
            input_grads = [i for i, (event, _) in enumerate(step) if event == "input-grad"]
            assert len(input_grads) == MICRO  # one per micro-batch's backward
            first_issue = step.index(("issue", issued[0]))
            assert first_issue > input_grads[-2], "nothing issued before the last backward"
            last_backward_reached_layer0 = input_grads[-1]
            for unit in ("layers.1", experts[0]):
                assert step.index(("issue", unit)) < last_backward_reached_layer0, (unit, step)
            assert step.index(("issue", "")) > last_backward_reached_layer0  # the root holds the embedding


def test_without_the_flag_nothing_is_reduced_early(results):
    for per_rank in results:
        run = per_rank[("full", True, False)]
        assert run["units"] == ["", *[u for u in run["units"] if u.endswith("experts")]]  # no layer units
        assert {event for event, _ in run["events"]} == {"step", "input-grad"}
