"""Export to the Hub's layout without gathering the model, on 4 gloo ranks at ``pp=2, vpp=2, ep=2, shard="full"``
(dp=2): from the live run (``MoEOverlapStrategy.export_hf``) and from the run's sharded checkpoint read in parts by
the same 4 processes (``export_checkpoint_hf``), for HF Qwen3-MoE and DeepSeek-V3 (its correction bias buffer).

Oracles:
- transformers' ``from_pretrained`` of each folder, with no missing, unexpected or misshapen key, bitwise equal to the
  run's consolidated state (``full_state_dict``: DCP's own gather, another path than the export's);
- the folder layout of the one-process ``export_hf`` of that consolidated state (the same files and weight map);
- a count of what each rank wrote: the ranks' bytes add up to the folder's total size (each element written once),
  and no rank writes more than it holds (no rank gathers the model).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from torch.distributed.tensor import DTensor

from lightning_moe_overlap import MoEOverlapStrategy
from tests.distributed.test_pipeline_sharded import CLIP, _trainer, build, loader
from tests.helpers.distributed import run_distributed

WORLD, EP, PP, STEPS, M = 4, 2, 2, 1, 2
KINDS = ("qwen3", "deepseek")


def _held_bytes(tensors: dict[str, torch.Tensor]) -> int:
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors.values()]
    return sum(t.numel() * t.element_size() for t in local)


def worker(rank: int, world: int, root: Path) -> dict:
    from lightning_moe_overlap.hf.sharded_export import export_checkpoint_hf

    out: dict = {}
    for kind in KINDS:
        model = build(kind)
        strategy = MoEOverlapStrategy(ep=EP, pp=PP, vpp=2, shard="full", num_microbatches=M, timeout=120)
        trainer = _trainer(strategy, [], world, max_steps=STEPS, gradient_clip_val=CLIP, enable_checkpointing=False)
        coords = strategy.dims.coords(trainer.global_rank)
        trainer.fit(model, train_dataloaders=loader(coords.dp, strategy.dims.dp, STEPS))
        trainer.save_checkpoint(root / kind / "run.ckpt")
        live = strategy.export_hf(root / kind / "live", max_shard_bytes="20KB")
        config = model.model.config
        saved = export_checkpoint_hf(root / kind / "run.ckpt", root / kind / "saved", config=config,
                                     max_shard_bytes="20KB")  # fmt: skip
        held = {k: v for k, v in strategy.held_tensors().items() if k.startswith("model.")}
        out[kind] = {
            "full": strategy.full_state_dict(),
            "config": config,
            "live_bytes": live.bytes_written,
            "saved_bytes": saved.bytes_written,
            "held_bytes": _held_bytes(held),
            "files": live.files,
        }
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    root = tmp_path_factory.mktemp("export")
    return run_distributed(worker, WORLD, root, timeout_s=300), root


def _total_size(folder: Path) -> int:
    return json.loads((folder / "model.safetensors.index.json").read_text())["metadata"]["total_size"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("source", ["live", "saved"])
def test_the_folder_loads_bitwise_the_consolidated_model(results, kind, source) -> None:
    from transformers import AutoModelForCausalLM

    per_rank, root = results
    full = {k.removeprefix("model."): v for k, v in per_rank[0][kind]["full"].items() if k.startswith("model.")}
    loaded, info = AutoModelForCausalLM.from_pretrained(root / kind / source, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    state = loaded.state_dict()
    assert state.keys() == full.keys()
    differ = [k for k in full if state[k].dtype != full[k].dtype or not torch.equal(state[k], full[k])]
    assert differ == []


@pytest.mark.parametrize("kind", KINDS)
def test_the_layout_is_the_one_process_exports(results, kind, tmp_path) -> None:
    from lightning_moe_overlap.hf import export_hf

    per_rank, root = results
    whole = export_hf(per_rank[0][kind]["full"], tmp_path / "whole", config=per_rank[0][kind]["config"],
                      prefix="model.", max_shard_bytes="20KB")  # fmt: skip
    for source in ("live", "saved"):
        folder = root / kind / source
        names = sorted(p.name for p in folder.iterdir() if p.name != "generation_config.json")
        assert names == sorted(p.name for p in whole.iterdir())
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        expected = json.loads((whole / "model.safetensors.index.json").read_text())
        assert index == expected
    assert len(per_rank[0][kind]["files"]) > 2
    assert (root / kind / "live" / "generation_config.json").is_file()  # the live model's decoding defaults


@pytest.mark.parametrize("kind", KINDS)
def test_each_rank_writes_its_own_share_once(results, kind) -> None:
    per_rank, root = results
    for source in ("live", "saved"):
        written = [r[kind][f"{source}_bytes"] for r in per_rank]
        assert sum(written) == _total_size(root / kind / source), (source, written)
        assert all(w > 0 for w in written), (source, written)
    total = _total_size(root / kind / "live")
    for r, found in enumerate(per_rank):
        assert found[kind]["live_bytes"] <= found[kind]["held_bytes"] < total, (r, found[kind])
        assert found[kind]["saved_bytes"] <= 1.5 * total / WORLD, (r, found[kind]["saved_bytes"])  # rows of each
