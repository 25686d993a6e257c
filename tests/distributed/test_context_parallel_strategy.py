"""Context parallelism under MoEOverlapStrategy(cp=2, ep=2) on 4 gloo ranks (dp=2; ep folds over dp x cp).

Oracles: a single process training the unsplit ``MoEGPT`` on the same global batches, whole sequences (its own
loss, aux loss and shared expert included); at cp=2 the overlapped schedule bitwise equal to the sequential one; the
bytes autograd saves for backward in one micro-batch's forward (saved-tensor hooks) at cp=2 against cp=1.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.callbacks import SelectiveRecompute
from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.moe.router import TopKRouter
from tests.helpers.data import RandomTokens
from tests.helpers.distributed import run_distributed, run_distributed_expect_errors

WORLD, CP, STEPS, BATCH, MICRO, SEQ = 4, 2, 3, 4, 2, 17  # 16 input tokens: 2 x cp = 4 chunks of 4
VAL = 8  # validation samples: one batch per dp rank
GPT_CONFIG = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_experts=4, top_k=2, ffn_hidden_size=16,
           shared_expert_ffn_hidden_size=16, aux_loss_coeff=1e-2, lr=1e-2)  # fmt: skip


class Tokens(RandomTokens):
    def __init__(self, n: int = 64, seq: int = SEQ, vocab: int = 64) -> None:
        super().__init__(n, seq, vocab, seed=7, indexed=True)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class GPT(MoEGPT):
    """Records what each rank trained on and the bytes saved for backward by each training step's forward (not part
    of the computation)."""

    seq = SEQ

    def __init__(self) -> None:
        super().__init__(**GPT_CONFIG, seed=3)
        self.seen: list[int] = []
        self.saved_bytes: list[int] = []

    def training_step(self, batch, batch_idx):
        tokens, idx = batch
        self.seen.extend(idx.tolist())
        saved = [0]
        weights = {_local(p).untyped_storage().data_ptr() for p in self.parameters()}

        def pack(t: torch.Tensor) -> torch.Tensor:
            held = _local(t)
            if held.untyped_storage().data_ptr() not in weights:  # activations only, not the weights linears keep
                saved[0] += held.numel() * held.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = super().training_step(tokens, batch_idx)
        self.saved_bytes.append(saved[0])
        return loss

    def train_dataloader(self):
        return DataLoader(Tokens(seq=self.seq), batch_size=BATCH)


def _fit(validate: bool = False, callbacks=(), **kwargs) -> dict:
    torch.manual_seed(0)
    model = GPT()
    losses: list[float] = []
    trainer = Trainer(
        accelerator="cpu", devices=WORLD, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
        strategy=MoEOverlapStrategy(num_microbatches=MICRO, **{"cp": CP, "ep": 2, **kwargs}),
    )
    model.on_train_batch_end = lambda outputs, *_: losses.append(float(outputs["loss"]))
    trainer.fit(model)
    val_loss = None
    if validate:  # the module shards the validation batches alike; sync_dist averages the ranks' losses
        (metrics,) = trainer.validate(model, DataLoader(Tokens(n=VAL).data, batch_size=BATCH), verbose=False)
        val_loss = metrics["val_loss"]
    state = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
             for n, p in model.named_parameters()}  # fmt: skip
    return {"losses": losses, "seen": model.seen, "state": state, "saved_bytes": model.saved_bytes,
            "val_loss": val_loss}


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    return {
        "gpt": _fit(validate=True, overlap=False),
        "gpt_overlap": _fit(overlap=True),
        "gpt_cp1": _fit(cp=1, overlap=False),
        # recomputed in backward: the attention call alone (overlapped), two-layer units (sequential)
        "gpt_recompute_attn": _fit(overlap=True, callbacks=[SelectiveRecompute(["core_attn"])]),
        "gpt_recompute_full": _fit(overlap=False, callbacks=[SelectiveRecompute(granularity="full", num_layers=2)]),
    }


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_worker, WORLD, timeout_s=300)


def _reference(model, seen_per_dp: list[list[int]]) -> list[float]:
    """One process, the unsplit model on whole sequences: each step's loss is the mean over dp ranks and
    micro-batches."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = Tokens().data
    size = BATCH // MICRO
    for router in (m for m in model.modules() if isinstance(m, TopKRouter)):  # the step's loss is a mean of parts
        router.aux_loss_scale = 1.0 / (len(seen_per_dp) * MICRO)
    losses = []
    for step in range(STEPS):
        first = step * BATCH
        parts = [seen[first + m * size : first + (m + 1) * size] for seen in seen_per_dp for m in range(MICRO)]
        opt.zero_grad()
        loss = torch.stack([_loss_of(model, data[p]) for p in parts]).mean()
        loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
    return losses


def _loss_of(model, tokens):
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def test_moegpt_at_cp2_follows_one_process(results):
    runs = [r["gpt"] for r in results]
    assert runs[0]["seen"] == runs[1]["seen"] and runs[0]["seen"] != runs[2]["seen"]  # cp peers share samples
    torch.manual_seed(0)
    model = MoEGPT(**GPT_CONFIG, seed=3)
    ref = _reference(model, [runs[0]["seen"], runs[2]["seen"]])
    # each rank's loss is the mean over its half of the tokens: the mean over all ranks is the step's loss
    dist_losses = [sum(run["losses"][s] for run in runs) / WORLD for s in range(STEPS)]
    torch.testing.assert_close(torch.tensor(dist_losses), torch.tensor(ref), rtol=1e-4, atol=0)
    for name, value in model.state_dict().items():
        if name in runs[0]["state"]:
            torch.testing.assert_close(runs[0]["state"][name], value, rtol=1e-4, atol=1e-4, msg=name)
    model.eval()
    with torch.no_grad():  # validation after the 3 steps: the mean loss over the validation samples, whole sequences
        want = float(_loss_of(model, Tokens(n=VAL).data))
    for rank, run in enumerate(runs):
        assert abs(run["val_loss"] - want) <= 1e-4 * abs(want), (rank, run["val_loss"], want)


def test_overlap_at_cp2_is_bitwise_equal_to_sequential(results):
    for r in results:
        assert r["gpt_overlap"]["losses"] == r["gpt"]["losses"]
        for name, value in r["gpt"]["state"].items():
            assert torch.equal(r["gpt_overlap"]["state"][name], value), name


def test_recompute_at_cp2_is_bitwise_equal_to_keeping_activations(results):
    """A recomputation runs inside the backward, outside every thread's ring mode: it must re-enter the ring (plain
    attention over the rank's own tokens would change the gradients). Recomputing saves less, so it did run."""
    for r in results:
        for name, kept in (("gpt_recompute_attn", "gpt_overlap"), ("gpt_recompute_full", "gpt")):
            assert r[name]["losses"] == r[kept]["losses"], name
            for key, value in r[kept]["state"].items():
                assert torch.equal(r[name]["state"][key], value), (name, key)
            assert sum(r[name]["saved_bytes"]) < sum(r[kept]["saved_bytes"]), name


def test_cp2_saves_about_half_the_activations(results):
    """Bytes saved for backward per micro-batch forward (mean over the steps) at cp=2 over cp=1, the same sequences.
    The routed rows a rank's experts receive vary with routing, so the ratio is about, not exactly, one half."""
    for rank, r in enumerate(results):
        cp2, cp1 = (sum(r[k]["saved_bytes"]) / len(r[k]["saved_bytes"]) for k in ("gpt", "gpt_cp1"))
        print(f"rank {rank}: saved for backward per micro-batch, cp=2 {cp2:.0f} B, cp=1 {cp1:.0f} B, {cp2 / cp1:.3f}")
        assert 0.4 <= cp2 / cp1 <= 0.6, (rank, cp2, cp1)


class Odd(GPT):
    seq = 11  # 10 input tokens: not a multiple of 2 x cp = 4


def _odd_sequence(rank: int, world: int) -> None:
    torch.manual_seed(0)
    trainer = Trainer(
        accelerator="cpu", devices=world, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        strategy=MoEOverlapStrategy(num_microbatches=MICRO, cp=2, ep=2),
    )
    trainer.fit(Odd())


@pytest.mark.long  # the message itself is tested in tests/unit/test_context_batch.py
def test_a_sequence_2cp_does_not_divide_fails_at_the_first_step():
    errors = run_distributed_expect_errors(_odd_sequence, WORLD, timeout_s=120)
    assert errors, "the run did not fail"
    for rank, text in errors.items():
        assert "rule `cp-divides-sequence`" in text and "Sequence length 10 is not divisible by 4 (cp=2" in text, text
        assert "(for example 12)" in text, text
