"""Batches at pp > 1 under ``Trainer(strategy=MoEOverlapStrategy(pp=2))`` on 2 gloo ranks (ep=1, dp=1), HF Qwen3-MoE.

One spawn, several fits on the same processes, every loader in order (``use_distributed_sampler=False``):
- SFT dict batches (``input_ids``, ``labels`` with -100 on prompt and padding tokens, a left-padding
  ``attention_mask``, ``position_ids``) at pp=2 under DualPipeV with the overlap, and the same at pp=1 (ep=2 over the
  2 ranks, both reading the same batches): per-step losses on every rank and the parameters after the steps equal
  HF's own ``forward(**batch).loss`` of each whole batch trained in one process on the same weights (the step's
  loss is the per-token mean over its micro-batches, docs/overlap.md "Which mean a step's loss is");
- ``from_pretrained`` inside ``configure_model`` at pp=2 (a module with ``build_on_meta = False``, 1F1B),
  fed a ``TensorDataset``'s list batches: the first loss is HF's next-token loss of the model loaded from the
  ``save_pretrained`` directory;
- a batch the built-in split does not take (a list of two tensors) fails on every rank before the first step,
  naming its type and the hook.

Shapes: B samples per step, S tokens, M micro-batches.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo_hf import HFMoECausalLM
from lightning_moe_overlap.parallel.dtensors import local
from tests.helpers.distributed import run_distributed

pytest.importorskip("transformers", reason="Requires: transformers>=5")

WORLD, B, S, M, STEPS, LR, VOCAB = 2, 4, 8, 4, 2, 0.5, 128
QWEN = {"num_hidden_layers": 4}


def sft_samples(n: int = B * STEPS) -> dict[str, torch.Tensor]:
    """``n`` left-padded samples: labels -100 on the padding and on a prompt of 2-3 tokens after it; position ids
    counting the tokens (every fourth sample restarting them)."""
    g = torch.Generator().manual_seed(3)
    ids_NS = torch.randint(2, VOCAB, (n, S), generator=g)
    pad_N = torch.arange(n) % 3  # 0, 1 or 2 padding tokens on the left
    mask_NS = (torch.arange(S)[None, :] >= pad_N[:, None]).long()
    ids_NS = torch.where(mask_NS.bool(), ids_NS, torch.zeros_like(ids_NS))
    labels_NS = ids_NS.clone()
    labels_NS[torch.arange(S)[None, :] < (pad_N + 2 + torch.arange(n) % 2)[:, None]] = -100
    position_NS = (mask_NS.cumsum(1) - 1).clamp(min=0)
    position_NS[3::4] = torch.arange(S) % 5  # restarts: relative positions that differ from the default's
    return {"input_ids": ids_NS, "labels": labels_NS, "attention_mask": mask_NS, "position_ids": position_NS}


class SFTDataset(Dataset):
    def __init__(self) -> None:
        self.samples = sft_samples()

    def __len__(self) -> int:
        return len(self.samples["input_ids"])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.samples.items()}


def tokens(n: int = B) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, S), generator=torch.Generator().manual_seed(5))


class SGDQwen3(HFMoECausalLM):
    def __init__(self) -> None:
        super().__init__(model_type="qwen3_moe", config_overrides=QWEN)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


class Pretrained(SGDQwen3):
    """Loads the HF model in ``configure_model`` (Lightning's place for big models), out of the meta device."""

    build_on_meta = False

    def __init__(self, path: str) -> None:
        LightningModule.__init__(self)
        self.path, self.model = path, None

    def configure_model(self) -> None:
        from transformers import AutoModelForCausalLM

        if self.model is None:
            self.model = AutoModelForCausalLM.from_pretrained(self.path)


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def fit(model: LightningModule, loader: DataLoader, steps: int, **strategy_kwargs) -> dict:
    record = Losses()
    strategy = MoEOverlapStrategy(timeout=120, **strategy_kwargs)
    trainer = Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=steps, limit_val_batches=0, logger=False,
        use_distributed_sampler=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[record],
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=loader)
    return {
        "losses": record.losses,
        "ep_rank": strategy.dims.coords(trainer.global_rank).ep,
        "params": {n: local(p).detach().clone() for n, p in model.named_parameters() if not p.is_meta},
    }


def fit_error(loader: DataLoader) -> dict:
    record = Losses()
    trainer = Trainer(
        accelerator="cpu", devices=WORLD, strategy=MoEOverlapStrategy(pp=2, num_microbatches=2, timeout=120),
        max_steps=1, limit_val_batches=0, logger=False, use_distributed_sampler=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[record],
    )  # fmt: skip
    try:
        trainer.fit(SGDQwen3(), train_dataloaders=loader)
    except TypeError as err:
        return {"error": str(err), "steps": len(record.losses)}
    return {"error": None, "steps": len(record.losses)}


def worker(rank: int, world_size: int, pretrained: str) -> dict:
    torch.use_deterministic_algorithms(True)
    sft = DataLoader(SFTDataset(), batch_size=B)
    return {
        "pp2": fit(SGDQwen3(), sft, STEPS, pp=2, vpp=2, pipeline_schedule="dualpipev", num_microbatches=M),
        "pp1": fit(SGDQwen3(), sft, STEPS, ep=2, num_microbatches=M),
        "pretrained": fit(
            Pretrained(pretrained), DataLoader(TensorDataset(tokens()), batch_size=B), 1, pp=2, num_microbatches=2
        ),
        "bad": fit_error(DataLoader(TensorDataset(tokens(), tokens()), batch_size=B)),
    }


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Qwen3-MoE saved with ``save_pretrained`` (its own seed: not the weights ``SGDQwen3`` starts from)."""
    path = str(tmp_path_factory.mktemp("pretrained") / "qwen3_moe")
    HFMoECausalLM("qwen3_moe", seed=11, config_overrides=QWEN).model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def results(saved_model: str) -> list[dict]:
    return run_distributed(worker, WORLD, saved_model, timeout_s=240)


def reference_sft() -> tuple[list[float], dict[str, torch.Tensor]]:
    """HF's own loss in one process: per step ``forward(**batch).loss`` of the whole batch (its micro-batches hold
    unequal labelled tokens: not the mean of their means), SGD."""
    torch.use_deterministic_algorithms(True)
    model = SGDQwen3().model
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    samples, losses = sft_samples(), []
    for step in range(STEPS):
        opt.zero_grad()
        batch = {k: v[step * B : (step + 1) * B] for k, v in samples.items()}
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {f"model.{n}": p.detach() for n, p in model.named_parameters()}


def _expert_slice(ref: torch.Tensor, got: torch.Tensor, ep_rank: int) -> torch.Tensor:
    per = got.shape[0]
    return ref if got.shape == ref.shape else ref[ep_rank * per : (ep_rank + 1) * per]


def test_sft_dict_batches_at_pp2_and_pp1_match_hf_own_loss(results: list[dict]) -> None:
    ref_losses, ref_params = reference_sft()
    assert len(set(ref_losses)) == STEPS  # the steps change the model
    for rank, runs in enumerate(results):
        for name in ("pp2", "pp1"):
            run = runs[name]
            torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")  # fmt: skip
            assert run["params"], (rank, name)
            for pname, got in run["params"].items():
                want = _expert_slice(ref_params[pname], got, run["ep_rank"])
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{rank} {name} {pname}: {m}")
    held = [set(r["pp2"]["params"]) for r in results]
    assert held[0].isdisjoint(held[1]) and held[0] | held[1] == set(ref_params)  # each pp rank its own chunks


def test_unsupported_batch_fails_before_the_first_step_on_every_rank(results: list[dict]) -> None:
    for rank, runs in enumerate(results):
        error = runs["bad"]["error"]
        assert error is not None and runs["bad"]["steps"] == 0, (rank, runs["bad"])
        assert "got a list of 2 item(s) (Tensor, Tensor)" in error, error
        assert "configure_pipeline" in error and "prepare_batch" in error, error


def test_from_pretrained_in_configure_model_and_list_batches_at_pp2(results: list[dict], saved_model: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(saved_model)
    ids = tokens()
    with torch.no_grad():
        want = torch.stack([model(input_ids=part, labels=part).loss for part in ids.chunk(2)]).mean()
        other = SGDQwen3().model(input_ids=ids, labels=ids).loss  # the loss of weights not loaded from the directory
    assert abs(float(want) - float(other)) > 1e-3
    for rank, runs in enumerate(results):
        assert runs["pretrained"]["losses"] == pytest.approx([float(want)], rel=1e-5), rank
