"""``export_hf``: the Hub layout ``save_pretrained`` writes, sharded by size, which ``from_pretrained`` loads with no
missing or unexpected key and bitwise equal. Oracle: transformers (its ``save_pretrained`` keys and its loader)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
from safetensors import safe_open

from lightning_moe_overlap.hf import export_hf
from lightning_moe_overlap.hf.export import parse_size
from tests.helpers.hf_checkpoints import FAMILIES, state_equal, tiny_model


def _keys(folder) -> set[str]:
    out: set[str] = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            out |= set(f.keys())
    return out


@pytest.mark.parametrize("model_type", FAMILIES)
def test_export_round_trips_through_from_pretrained_bitwise(tmp_path, model_type):
    from transformers import AutoModelForCausalLM

    model = tiny_model(model_type, seed=0)
    model.save_pretrained(tmp_path / "hf")
    out = export_hf(model.state_dict(), tmp_path / "ours", config=model.config, max_shard_bytes=20_000)
    assert _keys(out) == _keys(tmp_path / "hf")  # the keys save_pretrained writes
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() and info["mismatched_keys"] == set()
    assert state_equal(model.state_dict(), loaded.state_dict()) == []


def test_one_shard_is_model_safetensors_and_tied_heads_are_left_out(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model("qwen3_moe", seed=0, tie_word_embeddings=True)
    prefixed = {f"model.{k}": v for k, v in model.state_dict().items()}
    out = export_hf(prefixed, tmp_path / "out", config=model.config, prefix="model.")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert "lm_head.weight" not in _keys(out)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert state_equal(model.state_dict(), loaded.state_dict()) == []


def test_a_config_path_and_a_dtype(tmp_path):
    model = tiny_model("mixtral", seed=0)
    model.config.save_pretrained(tmp_path / "cfg")
    out = export_hf(model.state_dict(), tmp_path / "out", config=tmp_path / "cfg", dtype=torch.bfloat16)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        w1 = f.get_tensor("model.layers.0.block_sparse_moe.experts.2.w1.weight")
    gate_up = model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"]
    assert w1.dtype == torch.bfloat16 and torch.equal(w1, gate_up[2, :16].to(torch.bfloat16))
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_a_non_empty_destination_is_refused_unless_overwrite(tmp_path):
    model = tiny_model("olmoe", seed=0)
    export_hf(model.state_dict(), tmp_path, config=model.config, max_shard_bytes="20KB")
    with pytest.raises(ValueError, match=r"is not empty .*Pass an empty or new folder, or overwrite=True"):
        export_hf(model.state_dict(), tmp_path, config=model.config)
    export_hf(model.state_dict(), tmp_path, config=model.config, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]  # old shards gone


def test_bad_inputs_are_named(tmp_path):
    model = tiny_model("qwen3_moe", seed=0)
    state = model.state_dict()
    with pytest.raises(ValueError, match=r"no key starts with prefix='net\.'"):
        export_hf(state, tmp_path / "a", config=model.config, prefix="net.")
    with pytest.raises(ValueError, match=r"is neither a config\.json nor a folder holding one"):
        export_hf(state, tmp_path / "b", config=tmp_path / "nowhere")
    (tmp_path / "c.json").write_text("{}")
    with pytest.raises(ValueError, match=r"the config has no `model_type`"):
        export_hf(state, tmp_path / "d", config=tmp_path / "c.json")
    bad = {**state, "model.layers.0.mlp.experts.gate_up_proj": torch.zeros(8, 31, 32)}
    with pytest.raises(ValueError, match=r"gate_up_proj of shape \[8, 31, 32\] cannot be cut"):
        export_hf(bad, tmp_path / "e", config=model.config)


def test_dtensors_are_refused(tmp_path, world_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    model = tiny_model("qwen3_moe", seed=0)
    part = distribute_tensor(torch.zeros(2), init_device_mesh("cpu", (1,)), [Replicate()])
    with pytest.raises(TypeError, match=r"\['x'\] are DTensors.*Pass the full state dict"):
        export_hf({"x": part}, tmp_path / "f", config=model.config)


@pytest.mark.parametrize(
    "size,expected", [(1000, 1000), ("5GB", 5 * 10**9), ("20KB", 20_000), ("500MiB", 500 * 2**20), ("1.5 GB", 1.5e9)]
)
def test_sizes_parse_as_save_pretrained_reads_them(size, expected):
    assert parse_size(size) == expected


@pytest.mark.parametrize("size", ["5 parsecs", "-1", 0, "GB"])
def test_a_bad_size_is_refused(size):
    with pytest.raises(ValueError, match=r"is not a positive size"):
        parse_size(size)


def test_a_file_destination_and_a_family_writing_one_key_twice_are_refused(tmp_path):
    from lightning_moe_overlap.hf import HFFamily

    model = tiny_model("qwen3_moe", seed=0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"is a file; the destination is a folder"):
        export_hf(model.state_dict(), tmp_path / "file", config=model.config)
    clash = HFFamily(name="clash", renames=((r"\.(q|k)_proj\.", ".qk_proj."),))
    with pytest.raises(ValueError, match=r"the key family 'clash' writes \['model\.layers\.0\.self_attn\.qk_proj"):
        export_hf(model.state_dict(), tmp_path / "out", config=model.config, family=clash)
