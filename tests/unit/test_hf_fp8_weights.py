"""Block-scaled FP8 checkpoints (DeepSeek-V3's published layout) loaded by ``load_hf_weights`` in one process.

Oracle: a tiny DeepSeek-V3 whose linears the test quantises blockwise with plain torch ops
(``tests/helpers/fp8_checkpoints.py``); their dequantisation by ``repeat_interleave`` of the scales, written as a
high-precision folder and read by transformers' ``from_pretrained``, is the state the load must give bitwise, and is
the original weights within e4m3's rounding. (transformers' own FP8 loader needs ``accelerate``, which the package
does not install, and derives the block from the scale grid, so it cannot read partial last blocks.)"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from lightning_moe_overlap.hf import HFWeights, export_hf, load_hf_weights, module_tensors
from lightning_moe_overlap.hf.fp8_weights import apply_scales, scale_read
from tests.helpers.fp8_checkpoints import (
    DEEPSEEK_FP8, dequantise, expected_state, fp8_checkpoint, quantise, within_e4m3,
)  # fmt: skip
from tests.helpers.hf_checkpoints import state_equal, tiny_model

BLOCK = (128, 128)


def _target(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return tiny_model("deepseek_v3", seed=1, **DEEPSEEK_FP8).to(dtype)


def _load(model: torch.nn.Module, path):
    held, shapes = module_tensors(model)
    return load_hf_weights(held, shapes, path)


def _oracle(files: dict, fp8, block=BLOCK) -> dict[str, torch.Tensor]:
    """The state transformers loads (float32) from the dequantised files, written next to the folder ``fp8``."""
    from transformers import AutoModelForCausalLM

    config = json.loads((fp8 / "config.json").read_text())
    config.pop("quantization_config", None)
    path = fp8.parent / "oracle"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file(expected_state(files, block), str(path / "model.safetensors"), metadata={"format": "pt"})
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


def test_the_fp8_files_load_dequantised_into_fp32_weights(tmp_path):
    original, files = fp8_checkpoint(tmp_path / "fp8")
    shapes = [tuple(w.shape) for w in original.values()]
    assert any(s[0] % 128 == 0 and s[1] % 128 for s in shapes) and any(s[0] % 128 for s in shapes)  # both kinds
    assert {files[k].dtype for k in original} == {torch.float8_e4m3fn}
    target = _target()
    report = _load(target, tmp_path / "fp8")
    assert state_equal(_oracle(files, tmp_path / "fp8"), target.state_dict()) == []
    assert report.keys == tuple(sorted(files)) and report.reads == len(files)  # every weight and scale, once
    assert report.dequantized == tuple(sorted(original)) and report.block == BLOCK
    assert report.describe().endswith(f"{len(original)} FP8 weight(s) dequantised with their [128, 128] block scales")
    for key, weight in original.items():
        assert within_e4m3(dequantise(files[key], files[key + "_scale_inv"], BLOCK), weight, files[key + "_scale_inv"],
                           BLOCK), key  # fmt: skip


def test_bf16_weights_get_the_float32_product_cast_to_bf16(tmp_path):
    _, files = fp8_checkpoint(tmp_path / "fp8")
    target = _target(torch.bfloat16)
    _load(target, tmp_path / "fp8")
    expected = {k: v.to(torch.bfloat16) for k, v in _oracle(files, tmp_path / "fp8").items()}
    assert state_equal(expected, target.state_dict()) == []


def test_scales_without_a_quantization_config_are_used_with_128_blocks(tmp_path):
    _, files = fp8_checkpoint(tmp_path / "fp8", config_block=None)
    target = _target()
    _load(target, tmp_path / "fp8")
    assert state_equal(_oracle(files, tmp_path / "fp8"), target.state_dict()) == []


def test_the_config_block_size_is_the_one_used(tmp_path):
    _, files = fp8_checkpoint(tmp_path / "fp8", block=(32, 64))
    target = _target()
    _load(target, tmp_path / "fp8")
    assert state_equal(_oracle(files, tmp_path / "fp8", (32, 64)), target.state_dict()) == []


@pytest.mark.parametrize("shape", [(256, 384), (300, 200)])  # whole blocks; partial last blocks
@pytest.mark.parametrize("box", [(0, 0, None, None), (5, 130, 140, 50), (128, 0, 100, 129), (255, 199, 1, 1)])
def test_a_box_of_a_weight_is_dequantised_with_the_blocks_that_cover_it(shape, box):
    torch.manual_seed(0)
    values, scale = quantise(torch.randn(shape), BLOCK)
    r0, c0, rows, cols = box
    rows, cols = rows or shape[0], cols or shape[1]
    item = ReadItem(
        type=LoadItemType.TENSOR, dest_index=MetadataIndex("w", torch.Size([r0, c0])),
        dest_offsets=torch.Size([r0, c0]), storage_index=MetadataIndex("w", torch.Size([0, 0])),
        storage_offsets=torch.Size([r0, c0]), lengths=torch.Size([rows, cols]),
    )  # fmt: skip
    read, buffer = scale_read(item, "w_scale_inv", BLOCK)
    (b0, b1), (n0, n1) = read.storage_offsets, read.lengths
    buffer.copy_(scale[b0 : b0 + n0, b1 : b1 + n1])  # what the reader copies
    view = values[r0 : r0 + rows, c0 : c0 + cols].float()
    apply_scales(view, buffer, (r0, c0), BLOCK)
    assert torch.equal(view, dequantise(values, scale, BLOCK)[r0 : r0 + rows, c0 : c0 + cols])


def _shapes():
    return module_tensors(_target())[1]


def test_a_scale_of_another_block_size_is_named_with_the_size_it_fits(tmp_path):
    fp8_checkpoint(tmp_path, block=(64, 64), config_block=[128, 128])
    key = r"model\.layers\.0\.mlp\.down_proj\.weight"
    shapes = r"shape \[3, 4\], but .* \[160, 256\] in blocks of \[128, 128\] needs \[2, 2\]"
    implied = r"\(it fits blocks of \[64, 64\]"
    with pytest.raises(ValueError, match=rf"(?s){key}_scale_inv: {shapes} {implied}.*Rule: each FP8.*Fix: set weight_"):
        HFWeights(tmp_path).check(_shapes())  # headers only, as `check` runs it


def test_a_single_block_scale_is_named_with_a_power_of_two_block_it_fits(tmp_path):
    _, files = fp8_checkpoint(tmp_path)
    key = "model.layers.0.self_attn.q_a_proj.weight_scale_inv"  # weight [64, 160]: one block needs >= 160 columns
    files[key] = torch.ones(1, 1)
    save_file(files, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{key}: shape \[1, 1\], .* needs \[1, 2\] \(it fits blocks of \[128, 256\]"):
        _load(_target(), tmp_path)


def test_a_scale_of_a_wrong_shape_is_named(tmp_path):
    _, files = fp8_checkpoint(tmp_path)
    key = "model.layers.0.self_attn.q_a_proj.weight_scale_inv"
    files[key] = torch.ones(1, 17)  # no block size gives 17 blocks of 160
    save_file(files, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{key}: shape \[1, 17\], but .* \[64, 160\] in blocks of \[128, 128\] "
                       r"needs \[1, 2\]\n"):  # fmt: skip
        _load(_target(), tmp_path)


def test_a_scale_without_its_weight_and_a_weight_without_its_scale_are_named(tmp_path):
    _, files = fp8_checkpoint(tmp_path)
    files["model.layers.0.mlp.extra.weight_scale_inv"] = torch.ones(1, 1)
    del files["model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"]
    files["model.layers.0.mlp.gate_proj.weight_scale_inv"] = torch.ones(2, 2, dtype=torch.int32)
    save_file(files, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"(?s)its weight model\.layers\.0\.mlp\.extra\.weight is absent.*"
                       r"gate_proj\.weight_scale_inv: dtype torch\.int32, not a floating-point scale.*"
                       r"experts\.3\.up_proj\.weight \[128, 160\]: FP8 with no .*_scale_inv"):  # fmt: skip
        _load(_target(), tmp_path)


def test_a_scale_of_a_high_precision_weight_is_named(tmp_path):
    _, files = fp8_checkpoint(tmp_path)
    files["model.layers.0.mlp.up_proj.weight"] = files["model.layers.0.mlp.up_proj.weight"].float()
    save_file(files, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"its weight model\.layers\.0\.mlp\.up_proj\.weight is torch\.float32, "
                       "not FP8"):  # fmt: skip
        _load(_target(), tmp_path)


@pytest.mark.parametrize("size", [[128], [128, 0], "128x128", [128.0, 128]])
def test_a_bad_block_size_in_the_config_is_refused(tmp_path, size):
    fp8_checkpoint(tmp_path, config_block=size)
    with pytest.raises(ValueError, match=r"weight_block_size=.*Rule: block-scaled FP8 weights .* two positive "):
        HFWeights(tmp_path).check(_shapes())


def test_a_scaled_weight_that_is_not_a_matrix_is_refused(tmp_path):
    _, files = fp8_checkpoint(tmp_path)
    files["model.layers.0.mlp.up_proj.weight"] = torch.zeros(2, 128, 160).to(torch.float8_e4m3fn)
    save_file(files, str(tmp_path / "model.safetensors"))
    with pytest.raises(NotImplementedError, match=r"not 2-D: \['model\.layers\.0\.mlp\.up_proj\.weight \[2, 128, "
                       r"160\]'\]\. Rule: .*Fix: store"):  # fmt: skip
        _load(_target(), tmp_path)


def test_export_of_a_model_loaded_from_fp8_writes_high_precision_without_quantization_config(tmp_path):
    from transformers import AutoConfig

    fp8_checkpoint(tmp_path / "fp8")
    target = _target()
    _load(target, tmp_path / "fp8")
    config = AutoConfig.from_pretrained(tmp_path / "fp8")
    assert getattr(config, "quantization_config", None)  # carried by the model's config
    out = export_hf(target.state_dict(), tmp_path / "out", config=config)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    again = _target()
    report = _load(again, out)
    assert state_equal(target.state_dict(), again.state_dict()) == []
    assert not any(k.endswith("_scale_inv") for k in report.keys)
