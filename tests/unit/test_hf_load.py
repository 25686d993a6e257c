"""``load_hf_weights`` in one process: the files ``save_pretrained`` writes (Hub layout, sharded or not), fused v5
keys, bf16 files, tied embeddings; and the one error naming missing, unexpected and misshapen keys.

Oracle: transformers itself. A tiny model writes its files with ``save_pretrained``; a model of the same config with
other random weights loads them, and its state dict must equal the writer's bitwise."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file

from lightning_moe_overlap.hf import HFKeysError, HFWeights, load_hf_weights, module_tensors
from tests.helpers.hf_checkpoints import FAMILIES, saved, state_equal, tiny_model


def _load(model: torch.nn.Module, path, **kwargs):
    held, shapes = module_tensors(model)
    return load_hf_weights(held, shapes, path, **kwargs)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_files_save_pretrained_writes_load_bitwise(tmp_path, model_type):
    source = saved(model_type, tmp_path)
    target = tiny_model(model_type, seed=1)
    assert state_equal(source.state_dict(), target.state_dict())  # different weights before the load
    report = _load(target, tmp_path)
    assert state_equal(source.state_dict(), target.state_dict()) == []
    files = load_file(tmp_path / "model.safetensors")
    assert report.keys == tuple(sorted(files)) and report.reads == len(files)  # every key, read once
    assert report.bytes_read == sum(t.numel() * t.element_size() for t in files.values())
    assert report.family == ("mixtral" if model_type == "mixtral" else "hub_experts")


def test_a_sharded_folder_with_an_index_loads(tmp_path):
    source = saved("qwen3_moe", tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 2
    target = tiny_model("qwen3_moe", seed=1)
    _load(target, tmp_path)
    assert state_equal(source.state_dict(), target.state_dict()) == []


def test_files_not_named_by_the_index_are_not_read(tmp_path):
    source = saved("olmoe", tmp_path, max_shard_size="20KB")
    save_file({"stray.weight": torch.zeros(2)}, str(tmp_path / "consolidated.safetensors"))
    target = tiny_model("olmoe", seed=1)
    _load(target, tmp_path)
    assert state_equal(source.state_dict(), target.state_dict()) == []


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_a_folder_with_the_models_fused_keys_loads(tmp_path, model_type):
    source = tiny_model(model_type, seed=0)
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(source.config.to_json_string())
    target = tiny_model(model_type, seed=1)
    report = _load(target, tmp_path)
    assert state_equal(source.state_dict(), target.state_dict()) == []
    assert any(k.endswith("experts.gate_up_proj") for k in report.keys)


def test_bf16_files_load_into_fp32_tensors(tmp_path):
    source = tiny_model("qwen2_moe", seed=0).to(torch.bfloat16)
    source.save_pretrained(tmp_path)
    target = tiny_model("qwen2_moe", seed=1)
    report = _load(target, tmp_path)
    expected = {k: v.float() for k, v in source.state_dict().items()}
    assert all(v.dtype == torch.float32 for v in target.state_dict().values())
    assert state_equal(expected, target.state_dict()) == []
    assert report.bytes_read == sum(t.numel() * 2 for t in load_file(tmp_path / "model.safetensors").values())


def test_tied_embeddings_fill_the_head_from_the_embedding(tmp_path):
    source = tiny_model("qwen3_moe", seed=0, tie_word_embeddings=True)
    source.save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    target = tiny_model("qwen3_moe", seed=1, tie_word_embeddings=True)
    _load(target, tmp_path)
    assert state_equal(source.state_dict(), target.state_dict()) == []


def test_hf_weights_loads_the_hf_model_under_its_prefix(tmp_path):
    source = saved("mixtral", tmp_path)
    holder = torch.nn.Module()
    holder.model = tiny_model("mixtral", seed=1)
    holder.head = torch.nn.Linear(2, 2)  # not the checkpoint's: left as it is
    head = holder.head.weight.detach().clone()
    report = HFWeights(tmp_path).load_into(holder)
    assert state_equal(source.state_dict(), holder.model.state_dict()) == []
    assert torch.equal(holder.head.weight, head) and report.tensors == len(source.state_dict())


def test_only_the_held_tensors_are_read(tmp_path):
    source = saved("qwen3_moe", tmp_path)
    target = tiny_model("qwen3_moe", seed=1)
    held, shapes = module_tensors(target)
    name = "model.layers.1.mlp.experts.down_proj"
    report = load_hf_weights({name: held[name]}, shapes, tmp_path)
    assert report.keys == tuple(sorted(f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(8)))
    assert torch.equal(target.state_dict()[name], source.state_dict()[name])


# -- nothing silently left at init ------------------------------------------------------------------------------
def _rewrite(tmp_path, change) -> None:
    files = load_file(tmp_path / "model.safetensors")
    change(files)
    save_file(files, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})


def test_one_experts_keys_left_out_fail_the_load_naming_them(tmp_path):
    saved("qwen3_moe", tmp_path)
    stem = "model.layers.1.mlp.experts.3"
    _rewrite(tmp_path, lambda f: [f.pop(f"{stem}.{p}_proj.weight") for p in ("gate", "up", "down")])
    target = tiny_model("qwen3_moe", seed=1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(HFKeysError, match=r"missing keys \(3;") as err:
        _load(target, tmp_path)
    text = str(err.value)
    for part in ("down_proj", "gate_proj", "up_proj"):
        assert f"model.layers.1.mlp.experts.{{3}}.{part}.weight" in text, text
    assert "unexpected" not in text  # the other experts' keys are not reported as unused
    assert state_equal(before, target.state_dict()) == []  # nothing was read


def test_an_extra_key_and_a_wrong_shape_are_named_in_the_same_error(tmp_path):
    saved("olmoe", tmp_path)

    def change(files):
        files["model.layers.0.mlp.extra.weight"] = torch.zeros(3)
        files["model.layers.0.mlp.experts.5.up_proj.weight"] = torch.zeros(15, 32)

    _rewrite(tmp_path, change)
    extra = r"unexpected keys \(1;.*\n    model\.layers\.\{0\}\.mlp\.extra\.weight"
    with pytest.raises(HFKeysError, match=extra) as err:
        _load(tiny_model("olmoe", seed=1), tmp_path)
    mismatch = r"shape mismatches \(1\):\n    model\.layers\.0\.mlp\.experts\.5\.up_proj\.weight: file \[15, 32\]"
    assert re.search(mismatch, str(err.value)), err.value
    assert "Rule: every element" in str(err.value) and "Fix:" in str(err.value)


def test_ignored_keys_are_not_unexpected(tmp_path):
    source = saved("deepseek_v3", tmp_path)
    _rewrite(tmp_path, lambda f: f.update({"model.layers.2.mtp.weight": torch.zeros(2)}))
    target = tiny_model("deepseek_v3", seed=1)
    with pytest.raises(HFKeysError, match=r"unexpected keys \(1;"):
        _load(target, tmp_path)
    _load(target, tmp_path, ignore=(r"^model\.layers\.2\.",))
    assert state_equal(source.state_dict(), target.state_dict()) == []


def test_a_config_of_another_size_names_the_mismatches(tmp_path):
    saved("mixtral", tmp_path)
    first = r"missing keys \(12;.*\n    model\.layers\.0\.block_sparse_moe\.experts\.\{4-5\}"
    with pytest.raises(HFKeysError, match=first) as err:
        _load(tiny_model("mixtral", seed=1, num_local_experts=6), tmp_path)
    assert "model.layers.1.block_sparse_moe.gate.weight: file [4, 32], model.layers.1.mlp.gate.weight [6, 32]" in str(
        err.value
    )


def test_names_outside_the_prefix_are_refused(tmp_path):
    saved("qwen3_moe", tmp_path)
    model = tiny_model("qwen3_moe", seed=1)
    with pytest.raises(ValueError, match=r"names outside prefix='net\.'.*Fix: pass the prefix"):
        _load(model, tmp_path, prefix="net.")


def test_an_unknown_family_is_refused(tmp_path):
    saved("qwen3_moe", tmp_path)
    with pytest.raises(ValueError, match=r"family='llama' is neither the name of a family nor a model_type"):
        _load(tiny_model("qwen3_moe", seed=1), tmp_path, family="llama")


def test_a_folder_without_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    with pytest.raises(ValueError, match=r"has no \*\.safetensors file"):
        _load(tiny_model("qwen3_moe", seed=1), tmp_path)
    with pytest.raises(ValueError, match=r"is not a directory"):
        _load(tiny_model("qwen3_moe", seed=1), tmp_path / "config.json")


def test_a_meta_tensor_cannot_be_loaded(tmp_path):
    saved("qwen3_moe", tmp_path)
    model = tiny_model("qwen3_moe", seed=1)
    held, shapes = module_tensors(model)
    held["model.norm.weight"] = torch.empty(32, device="meta")
    with pytest.raises(ValueError, match=r"model\.norm\.weight is on the meta device"):
        load_hf_weights(held, shapes, tmp_path)


def test_a_plain_tensor_of_another_shape_is_refused(tmp_path):
    saved("qwen3_moe", tmp_path)
    held, shapes = module_tensors(tiny_model("qwen3_moe", seed=1))
    held = {"model.norm.weight": torch.zeros(16)}
    with pytest.raises(ValueError, match=r"plain tensor of shape \[16\] but the model's shape of it is \[32\]"):
        load_hf_weights(held, shapes, tmp_path)



def test_folder_problems_are_named(tmp_path):
    saved("qwen3_moe", tmp_path)
    save_file({"model.norm.weight": torch.zeros(32)}, str(tmp_path / "copy.safetensors"))
    with pytest.raises(ValueError, match=r"key 'model\.norm\.weight' is in both .*Remove the duplicate file"):
        _load(tiny_model("qwen3_moe", seed=1), tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(ValueError, match=r"names files that are not in the folder: \['gone\.safetensors'\]"):
        _load(tiny_model("qwen3_moe", seed=1), tmp_path)


def test_a_dtype_torch_does_not_read_is_named(tmp_path):
    saved("qwen3_moe", tmp_path)
    save_file({"odd": torch.zeros(2, dtype=torch.uint16)}, str(tmp_path / "odd.safetensors"))
    with pytest.raises(ValueError, match=r"key 'odd' of odd\.safetensors has dtype U16"):
        _load(tiny_model("qwen3_moe", seed=1), tmp_path)


def test_a_partial_dtensor_is_refused(tmp_path, world_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    saved("qwen3_moe", tmp_path)
    held, shapes = module_tensors(tiny_model("qwen3_moe", seed=1))
    part = DTensor.from_local(torch.zeros(32), init_device_mesh("cpu", (1,)), [Partial()])
    with pytest.raises(NotImplementedError, match=r"model\.norm\.weight is a DTensor with placements .*Partial"):
        load_hf_weights({"model.norm.weight": part}, shapes, tmp_path)
