"""``export_hf_sharded`` in one process: the folder ``export_hf`` writes (same files, same weight map) and
``from_pretrained`` loads bitwise, from whole tensors and from a ``DTensor`` on a world of one; each error names the
values, the rule and the fix. Oracle: transformers' loader and the whole-model export. The 4-process runs are in
``tests/distributed/test_hf_export_sharded.py``."""

from __future__ import annotations

import json

import pytest
import torch
from lightning.pytorch import LightningModule
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan

pytest.importorskip("transformers")

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.hf import export_hf
from lightning_moe_overlap.hf.keys import Piece
from lightning_moe_overlap.hf.planner import Chunk
from lightning_moe_overlap.hf.save_planner import PieceSavePlanner
from lightning_moe_overlap.hf.sharded_export import export_checkpoint_hf, export_hf_sharded, hf_model_path
from tests.helpers.hf_checkpoints import FAMILIES, state_equal, tiny_model


def _shapes(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in state.items()}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_one_process_writes_what_export_hf_writes_and_it_loads_bitwise(tmp_path, model_type):
    from transformers import AutoModelForCausalLM

    model = tiny_model(model_type, seed=0)
    state = model.state_dict()
    report = export_hf_sharded(state, _shapes(state), tmp_path / "parts", config=model.config, max_shard_bytes=20_000)
    whole = export_hf(state, tmp_path / "whole", config=model.config, max_shard_bytes=20_000)
    assert sorted(p.name for p in report.folder.iterdir()) == sorted(p.name for p in whole.iterdir())
    index = json.loads((report.folder / "model.safetensors.index.json").read_text())
    assert index == json.loads((whole / "model.safetensors.index.json").read_text())
    assert report.bytes_written == index["metadata"]["total_size"] and report.files == tuple(
        sorted(p.name for p in whole.glob("*.safetensors"))
    )
    loaded, info = AutoModelForCausalLM.from_pretrained(report.folder, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    assert state_equal(state, loaded.state_dict()) == []


def test_one_file_a_dtype_and_a_dtensor_on_a_world_of_one(tmp_path, world_of_one):
    from safetensors import safe_open
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    model = tiny_model("qwen3_moe", seed=0)
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    mesh = init_device_mesh("cpu", (1,))
    held = {k: distribute_tensor(v, mesh, [Shard(0)]) if v.dim() else v for k, v in state.items()}
    out = export_hf_sharded(held, _shapes(state), tmp_path / "out", config=model.config, prefix="model.",
                            dtype=torch.bfloat16).folder  # fmt: skip
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        key = "model.layers.0.mlp.experts.1.down_proj.weight"
        assert torch.equal(f.get_tensor(key), model.model.layers[0].mlp.experts.down_proj[1].to(torch.bfloat16))


def test_the_non_empty_destination_and_the_prefix_are_named(tmp_path):
    model = tiny_model("mixtral", seed=0)
    state = model.state_dict()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "old.txt").write_text("x")
    with pytest.raises(ValueError, match=r"is not empty .* overwrite=True"):
        export_hf_sharded(state, _shapes(state), tmp_path / "busy", config=model.config)
    with pytest.raises(ValueError, match=r"no key starts with prefix='net\.'.*Pass the prefix"):
        export_hf_sharded(state, _shapes(state), tmp_path / "a", config=model.config, prefix="net.")
    assert not (tmp_path / "a").exists()


def test_a_tensor_no_rank_holds_and_a_held_one_without_a_shape_are_named(tmp_path):
    model = tiny_model("mixtral", seed=0)
    state = model.state_dict()
    held = {k: v for k, v in state.items() if "layers.1." not in k}
    with pytest.raises(ValueError, match=r"no rank holds \['model\.layers\.1\..*Rule: every tensor .* Fix: call it"):
        export_hf_sharded(held, _shapes(state), tmp_path / "a", config=model.config)
    shapes = {k: s for k, s in _shapes(state).items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match=r"\['lm_head\.weight'\] are held but have no global shape.*Fix: pass both"):
        export_hf_sharded(state, shapes, tmp_path / "b", config=model.config)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_coordinator_refuses_parts_that_do_not_cover_a_tensor():
    piece = Piece("w", ((0, 4), (0, 2)))
    halves = []
    for offset in (0, 2):
        planner = PieceSavePlanner({"w": [piece]})
        planner.set_up_planner({"w": Chunk(torch.zeros(2, 2), (offset, 0))})
        halves.append(planner.create_local_plan())
    plans, metadata = PieceSavePlanner({}).create_global_plan(halves)  # two disjoint halves: covered
    assert [len(p.items) for p in plans] == [1, 1] and list(metadata.state_dict_metadata) == ["w"]
    replicas = PieceSavePlanner({}).create_global_plan([halves[0], halves[0], halves[1], halves[1]])[0]
    assert sum(len(p.items) for p in replicas) == 2  # a replicated box is written by one of its holders
    with pytest.raises(ValueError, match=r"parts of w \(shape \[4, 2\]\) cover 4 of its 8 elements"):
        PieceSavePlanner({}).create_global_plan([halves[0], SavePlan([])])
    assert halves[0].items[0].index == MetadataIndex("w", torch.Size([0, 0]))


def test_a_file_checkpoint_is_refused_by_the_reader_in_parts(tmp_path):
    (tmp_path / "c.ckpt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"is a file; reading it in parts .* Fix: export it in one process"):
        export_checkpoint_hf(tmp_path / "c.ckpt", tmp_path / "out", config=tmp_path)


def test_the_strategy_names_the_missing_config():
    class Plain(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)

    strategy = MoEOverlapStrategy()
    strategy.connect(Plain())
    with pytest.raises(ValueError, match=r"holds no Hugging Face causal LM .* Fix: pass `config=`"):
        strategy.export_hf("unused")
    model = tiny_model("mixtral", seed=0)
    holder = torch.nn.Module()
    holder.model = model
    assert hf_model_path(holder) == ("model.", model) and hf_model_path(model) == ("", model)


@pytest.mark.parametrize("sharded", [False, True])
def test_tensors_that_are_not_the_configs_model_are_refused_before_writing(tmp_path, sharded):
    """A config of another size, a prefix that keeps too little of the names, one without its dot: each would load
    with missing or unexpected keys (transformers' own model of the config is the oracle)."""
    from lightning_moe_overlap.demo_hf import build_hf_model

    model = tiny_model("qwen3_moe", seed=0)
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    smaller = build_hf_model("qwen3_moe", num_hidden_layers=1).config

    def export(dst, config, prefix):
        if sharded:
            return export_hf_sharded(state, _shapes(state), dst, config=config, prefix=prefix)
        return export_hf(state, dst, config=config, prefix=prefix)

    with pytest.raises(ValueError, match=r"not the model of the config .*'num_hidden_layers': 1.*unexpected "
                       r"\['model\.layers\.1\..*Fix: pass the config of the model that was trained"):  # fmt: skip
        export(tmp_path / "a", smaller, "model.")
    with pytest.raises(ValueError, match=r"missing \['lm_head\.weight', .*unexpected \['embed_tokens"):
        export(tmp_path / "b", model.config, "model.model.")
    with pytest.raises(ValueError, match=r"unexpected \['\.lm_head\.weight'"):
        export(tmp_path / "c", model.config, "model")
    assert not any((tmp_path / n).exists() for n in "abc")


def test_the_files_are_readable_by_others_as_the_umask_allows(tmp_path):
    import os

    model = tiny_model("mixtral", seed=0)
    umask = os.umask(0o022)
    try:
        out = export_hf(model.state_dict(), tmp_path / "out", config=model.config)
    finally:
        os.umask(umask)
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == {
        "config.json": 0o644, "model.safetensors": 0o644
    }  # fmt: skip


def test_the_generation_config_is_written_from_the_model_or_next_to_the_config(tmp_path):
    from transformers import GenerationConfig

    model = tiny_model("mixtral", seed=0)
    state = model.state_dict()
    generation = GenerationConfig(max_new_tokens=7, do_sample=True, temperature=0.5)
    out = export_hf_sharded(state, _shapes(state), tmp_path / "a", config=model.config, generation_config=generation)
    assert GenerationConfig.from_pretrained(out.folder).max_new_tokens == 7
    model.config.save_pretrained(tmp_path / "source")
    generation.save_pretrained(tmp_path / "source")  # a folder a run started from holds both
    copied = export_hf(state, tmp_path / "b", config=tmp_path / "source")
    assert GenerationConfig.from_pretrained(copied).temperature == 0.5
    assert not (export_hf(state, tmp_path / "c", config=model.config) / "generation_config.json").exists()
    with pytest.raises(ValueError, match=r"generation_config='.*nowhere' is neither a generation_config.json"):
        export_hf(state, tmp_path / "d", config=model.config, generation_config=tmp_path / "nowhere")


def test_an_incomplete_file_is_named_before_anything_is_read(tmp_path):
    from lightning_moe_overlap.hf import HFWeights

    model = tiny_model("qwen3_moe", seed=0)
    model.save_pretrained(tmp_path / "hf")
    file = tmp_path / "hf" / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])  # an interrupted copy
    shapes = {f"model.{k}": tuple(v.shape) for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"model\.safetensors is incomplete .* the file has .* Fix: download or copy"):
        HFWeights(tmp_path / "hf").check(shapes)
    file.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ValueError, match=r"its header is not a safetensors header"):
        HFWeights(tmp_path / "hf").check(shapes)
