"""A published checkpoint of every built-in family, loaded into the sharded model by the strategy (gloo, CPU).

``HFMoECausalLM(pretrained=FOLDER)`` under ``MoEOverlapStrategy``: the model is built from ``config.json`` on the
meta device, made expert-parallel, then every rank reads its part of the files (``parallelize/steps.py``,
``apply_pretrained``). Oracle: Hugging Face's own ``from_pretrained`` of the same folder (its own key conversion) in
this process: the strategy's gathered state before the first step equals its state dict bitwise, and each rank's
first-step loss equals HF's forward of that rank's batch (mean over the micro-batches) within 1e-5.

Runs: ep=2 on 2 ranks (every family at ``shard="none"``, Qwen3-MoE also at ``"optimizer"`` and ``"full"``, whose
dense shards read only their rows; also a folder with one expert's keys removed, which fails before the first step
naming them) and pp=2 x ep=2 on 4 ranks (the same families, Qwen3-MoE also at ``"full"``: each stage's chunks
sharded over its two dp ranks; ``long``: `python -m pytest -m long`, except Qwen3-MoE, which runs by default).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader

from lightning_moe_overlap import MoEOverlapStrategy
from tests.helpers.distributed import run_distributed
from tests.helpers.hf_checkpoints import FAMILIES, saved

transformers = pytest.importorskip("transformers", reason="Requires: transformers>=5")

MICRO, BATCH, SEQ, VOCAB = 2, 4, 6, 128


class FirstStep(Callback):
    """The gathered state once the strategy has set up (before any step), and the first step's batch and loss."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] | None = None
        self.batch: torch.Tensor | None = None
        self.loss: float | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        state = trainer.strategy.full_state_dict()  # collective; rank 0 gets it
        self.state = None if state is None else {k: v.clone() for k, v in state.items()}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batch = batch.clone()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.loss = float(outputs["loss"])


def _fit(folder: str, pp: int, shard: str = "none") -> dict:
    from lightning_moe_overlap.demo_hf import HFMoECausalLM

    torch.manual_seed(11)  # the random init the load must overwrite everywhere differs from the files
    data = torch.randint(0, VOCAB, (16, SEQ), generator=torch.Generator().manual_seed(5))
    model = HFMoECausalLM(pretrained=folder, lr=1e-2)
    model.train_dataloader = lambda: DataLoader(data, batch_size=BATCH)
    seen = FirstStep()
    trainer = Trainer(
        accelerator="cpu", devices=torch.distributed.get_world_size(), max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[seen],
        strategy=MoEOverlapStrategy(ep=2, pp=pp, num_microbatches=MICRO, shard=shard),
    )  # fmt: skip
    trainer.fit(model)
    return {"state": seen.state, "batch": seen.batch, "loss": seen.loss}


def _worker(
    rank: int, world: int, folders: dict[str, str], pp: int, broken: str | None, shards: tuple[str, ...]
) -> dict:
    torch.set_num_threads(1)
    out: dict = {name: _fit(folder, pp) for name, folder in folders.items()}
    for shard in shards:  # the other shard modes: dense shards read only their rows
        out[f"qwen3_moe:{shard}"] = _fit(folders["qwen3_moe"], pp, shard)
    if broken is not None:
        with pytest.raises(ValueError) as failure:
            _fit(broken, pp)
        out["broken"] = str(failure.value)
    return out


def _folders(root: Path, families: tuple[str, ...]) -> dict[str, str]:
    folders = {}
    for family in families:
        saved(family, root / family, seed=3)
        folders[family] = str(root / family)
    return folders


def _without_expert(source: Path, target: Path, expert: int) -> list[str]:
    """A copy of ``source`` lacking every key of ``expert`` in layer 1; the keys removed."""
    target.mkdir()
    (target / "config.json").write_text((source / "config.json").read_text())
    tensors = load_file(source / "model.safetensors")
    removed = sorted(k for k in tensors if f"layers.1.mlp.experts.{expert}." in k)
    save_file({k: v for k, v in tensors.items() if k not in removed}, target / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    return removed


def _check(results: list[dict], folders: dict[str, str]) -> None:
    from transformers import AutoModelForCausalLM

    for family, folder in folders.items():
        reference = AutoModelForCausalLM.from_pretrained(folder).eval()  # HF's own loader and key conversion
        expected = {f"model.{k}": v for k, v in reference.state_dict().items()}
        state = results[0][family]["state"]
        assert state is not None and state.keys() == expected.keys(), (family, state.keys() ^ expected.keys())
        differ = [k for k in expected if not torch.equal(state[k], expected[k])]
        assert not differ, (family, differ)
        for rank, run in enumerate(results):
            parts = run[family]["batch"].chunk(MICRO)
            with torch.no_grad():
                loss = torch.stack([reference(input_ids=p, labels=p).loss for p in parts]).mean()
            assert abs(run[family]["loss"] - float(loss)) <= 1e-5, (family, rank, run[family]["loss"], float(loss))


def test_every_family_loads_at_ep2_and_matches_hf_and_a_missing_expert_is_named(tmp_path):
    folders = _folders(tmp_path, FAMILIES)
    removed = _without_expert(tmp_path / "qwen3_moe", tmp_path / "broken", expert=5)
    assert removed  # gate, up and down of expert 5
    results = run_distributed(_worker, 2, folders, 1, str(tmp_path / "broken"), ("optimizer", "full"), timeout_s=600)
    shards = {f"qwen3_moe:{shard}": folders["qwen3_moe"] for shard in ("optimizer", "full")}
    _check(results, {**folders, **shards})
    for run in results:  # every rank refuses, before the first step, naming the expert's keys
        for key in ("gate_proj", "up_proj", "down_proj"):
            assert "missing keys (3;" in run["broken"] and f"layers.1.mlp.experts.{{5}}.{key}" in run["broken"]


@pytest.mark.parametrize(
    "families",
    [("qwen3_moe",), pytest.param(tuple(f for f in FAMILIES if f != "qwen3_moe"), marks=pytest.mark.long)],
    ids=["qwen3_moe", "other-families"],
)
def test_families_load_at_pp2_ep2_and_match_hf(tmp_path, families):
    folders = _folders(tmp_path, families)
    shards = ("full",) if "qwen3_moe" in families else ()  # each stage's chunks sharded over its 2 dp ranks
    results = run_distributed(_worker, 4, folders, 2, None, shards, timeout_s=600)
    _check(results, {**folders, **{f"qwen3_moe:{shard}": folders["qwen3_moe"] for shard in shards}})
    assert json.loads((tmp_path / families[0] / "config.json").read_text())["model_type"] == families[0]
