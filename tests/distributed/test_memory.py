"""The memory callbacks change nothing but memory: parameters after a few steps are ``torch.equal`` to the run
without them, on 2 gloo ranks, with the overlap on and off.

One spawn runs everything:

- engine level (no Trainer): this package's MoE GPT under ``OverlapEngine`` with 2 micro-batches, ep in {1, 2},
  every CPU dispatcher (alltoall, allgather, flex on the DeepEP test double), each callback alone and both;
- Trainer level: ``MoEOverlapStrategy(ep=2)`` with the callbacks in ``trainer.callbacks``, the demo MoE GPT and
  an HF transformers v5 Qwen3-MoE tiny model, overlap on and off.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

from lightning_moe_overlap import ActivationOffload, MoEOverlapStrategy, SelectiveRecompute
from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.demo_hf import HFMoECausalLM
from lightning_moe_overlap.parallel.grads import sync_gradients
from lightning_moe_overlap.moe.ep import apply_expert_parallel
from lightning_moe_overlap.overlap.engine import OverlapEngine
from lightning_moe_overlap.overlap.runtime import CommRuntime
from lightning_moe_overlap.parallel import ParallelDims
from tests.helpers.distributed import mesh_groups, run_distributed
from tests.unit.test_dispatch_flex import FakeDeepEPBuffer

WORLD, STEPS, MICRO, VOCAB, SEQ = 2, 2, 2, 64, 9
ALL_OFFLOAD = {
    "modules": ["attn_norm", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act"],
    "tensors": ["dispatched_input", "pre_mlp_layernorm_output"],
    "min_tensor_size": 0,
}
A2A = ["a2a_overlap_attn", "a2a_overlap_post_attn", "a2a_overlap_mlp"]
CALLBACKS = {
    "none": list,
    "selective": lambda: [SelectiveRecompute(modules=[*A2A, "core_attn", "moe_act", "shared_experts"])],
    "selective_hf": lambda: [SelectiveRecompute(modules=[*A2A, "core_attn", "moe_act"])],  # Qwen3: no shared expert
    "selective_moe": lambda: [SelectiveRecompute(modules=["moe", "layernorm"])],
    "full": lambda: [SelectiveRecompute(granularity="full", method="uniform", num_layers=2)],
    "offload": lambda: [ActivationOffload(**ALL_OFFLOAD)],
    "both": lambda: [
        SelectiveRecompute(modules=["core_attn", "moe_act"]),
        ActivationOffload(tensors=["dispatched_input", "pre_mlp_layernorm_output"], min_tensor_size=0),
    ],
}


GPT = {
    "vocab_size": VOCAB, "hidden_size": 32, "num_layers": 3, "num_heads": 4, "num_experts": 4,
    "ffn_hidden_size": 32, "shared_expert_ffn_hidden_size": 16, "seed": 0,
}


# -- engine level -----------------------------------------------------------------------------------------------
def _engine_run(rank, groups, dispatcher: str, overlap: bool, callbacks: str) -> list[torch.Tensor]:
    runtime = CommRuntime()
    model = MoEGPT(**GPT)
    knobs = {"deepep_buffer": FakeDeepEPBuffer(groups.ep)} if dispatcher == "flex" else {}
    experts = apply_expert_parallel(model, groups.ep, dispatcher=dispatcher, runtime=runtime, **knobs)
    cbs = CALLBACKS[callbacks]()
    for cb in cbs:
        cb.apply(model)
    expert_ids = {id(p) for m in experts for p in m.parameters()}
    dense = [p for p in model.parameters() if id(p) not in expert_ids]
    local = [p for p in model.parameters() if id(p) in expert_ids]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = OverlapEngine(runtime, overlap=overlap, timeout_s=60)
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (MICRO, 2, SEQ), generator=g)
        opt.zero_grad()
        engine.run(lambda i, t=tokens: model._loss(t[i]), lambda i, loss: (loss / MICRO).backward(), MICRO)
        sync_gradients(dense, local, dp_cp_group=groups.dp_cp, edp_group=groups.edp, dp_cp_size=WORLD)
        opt.step()
    _check_active(cbs)
    for cb in cbs:
        cb.remove()
    return [p.detach().clone() for p in model.parameters()]


def _check_active(cbs: list) -> None:
    """The comparison is not vacuous: the offload moved bytes, the recompute had wrapped modules."""
    for cb in cbs:
        if isinstance(cb, ActivationOffload):
            assert cb.engine is not None and cb.engine.stats.offloaded_bytes > 0, cb
        else:
            assert cb._handles, cb


ENGINE_CASES = [
    (ep, "alltoall", overlap, cbs)
    for ep in (1, 2)
    for overlap in (False, True)
    for cbs in ("selective", "selective_moe", "full", "offload", "both")
] + [(2, dispatcher, True, cbs) for dispatcher in ("allgather", "flex") for cbs in ("full", "both")]


def _engine_matrix(rank: int, groups_by_ep: dict) -> list[str]:
    failures = []
    references = {}
    for ep, dispatcher, overlap, cbs in ENGINE_CASES:
        key = (ep, dispatcher)
        if key not in references:
            references[key] = _engine_run(rank, groups_by_ep[ep], dispatcher, False, "none")
        got = _engine_run(rank, groups_by_ep[ep], dispatcher, overlap, cbs)
        if not all(torch.equal(a, b) for a, b in zip(got, references[key])):
            failures.append(f"ep={ep} {dispatcher} overlap={overlap} {cbs}")
    return failures


# -- Trainer level ----------------------------------------------------------------------------------------------
class _Tokens(torch.utils.data.Dataset):
    def __init__(self, vocab: int) -> None:
        self.data = torch.randint(0, vocab, (16, SEQ), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


class _GPT(MoEGPT):
    def __init__(self) -> None:
        super().__init__(**GPT, lr=1e-2)

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def train_dataloader(self):
        return DataLoader(_Tokens(VOCAB), batch_size=4)


class _HF(HFMoECausalLM):
    def __init__(self) -> None:
        super().__init__("qwen3_moe", config_overrides={"num_hidden_layers": 3})

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def train_dataloader(self):
        return DataLoader(_Tokens(128), batch_size=4)


def _fit(module_cls, overlap: bool, callbacks: str) -> list[torch.Tensor]:
    model = module_cls()
    trainer = Trainer(
        accelerator="cpu", devices=WORLD, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=CALLBACKS[callbacks](),
        strategy=MoEOverlapStrategy(ep=2, num_microbatches=MICRO, overlap=overlap),
    )
    probe = _Probe()
    trainer.callbacks.append(probe)
    trainer.fit(model)
    assert probe.checked
    return [p.detach().clone() for p in model.parameters()]


class _Probe(Callback):
    """Checks, during training, that the memory callbacks of the trainer are active."""

    checked = False

    def on_train_batch_end(self, trainer, *args) -> None:
        _check_active([cb for cb in trainer.callbacks if isinstance(cb, (ActivationOffload, SelectiveRecompute))])
        self.checked = True


TRAINER_CASES = [
    (_GPT, overlap, cbs) for overlap in (True, False) for cbs in ("full", "both")
] + [(_HF, True, cbs) for cbs in ("selective_hf", "full", "both")] + [(_HF, False, "both")]


def _trainer_matrix() -> list[str]:
    failures = []
    references = {}
    for module_cls, overlap, cbs in TRAINER_CASES:
        if module_cls not in references:
            references[module_cls] = _fit(module_cls, False, "none")
        got = _fit(module_cls, overlap, cbs)
        if not all(torch.equal(a, b) for a, b in zip(got, references[module_cls])):
            failures.append(f"{module_cls.__name__} overlap={overlap} {cbs}")
    return failures


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    groups_by_ep = {ep: mesh_groups(ParallelDims.from_world_size(world, ep=ep), rank) for ep in (1, 2)}
    return {"engine": _engine_matrix(rank, groups_by_ep), "trainer": _trainer_matrix()}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_worker, WORLD, timeout_s=120)


def test_callbacks_keep_engine_runs_bitwise_equal(results):
    """ep in {1, 2}, alltoall / allgather / flex, overlap on and off, each callback and both."""
    for rank, result in enumerate(results):
        assert result["engine"] == [], f"rank {rank}: parameters differ for {result['engine']}"


def test_callbacks_keep_trainer_runs_bitwise_equal(results):
    """MoEOverlapStrategy(ep=2) with the callbacks in trainer.callbacks: demo GPT and HF Qwen3-MoE."""
    for rank, result in enumerate(results):
        assert result["trainer"] == [], f"rank {rank}: parameters differ for {result['trainer']}"
