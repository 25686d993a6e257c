"""Block-quantised FP8 checkpoints as DeepSeek-V3 publishes them, written with plain torch ops (the tests' oracle).

``quantise`` cuts a weight into ``block`` tiles, scales each tile so its largest magnitude is e4m3's largest value
and stores ``float8_e4m3fn`` values with a float32 ``_scale_inv`` of ``ceil(shape / block)`` values; ``dequantise``
is the reverse by ``repeat_interleave`` of the scales, cropped to the weight's shape."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch

from tests.helpers.hf_checkpoints import tiny_model

E4M3_MAX = 448.0
QUANTISED = re.compile(r"^model\.layers\.\d+\..*_proj(_with_mqa)?\.weight$")  # DeepSeek-V3's FP8 linears
DEEPSEEK_FP8 = dict(hidden_size=160, intermediate_size=256, moe_intermediate_size=128, q_lora_rank=64, kv_lora_rank=64)
"""Dims that are multiples of 128 (256, 128) and that are not (160, 68, 64, 48, 32): full and partial blocks."""


def quantise(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float8_e4m3fn values, float32 scale_inv [ceil(R / b0), ceil(C / b1)])`` of a 2-D ``weight``."""
    rows, cols = weight.shape
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1], dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    tiles = padded.reshape(grid[0], block[0], grid[1], block[1])
    scale = (tiles.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp(min=1e-12)  # [grid0, grid1]
    values = (tiles / scale[:, None, :, None]).reshape(padded.shape)[:rows, :cols]
    return values.to(torch.float8_e4m3fn), scale


def dequantise(values: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``values * scale`` block by block, in float32."""
    rows, cols = values.shape
    full = scale.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)[:rows, :cols]
    return values.float() * full


def within_e4m3(dequantised: torch.Tensor, original: torch.Tensor, scale: torch.Tensor, block: tuple) -> bool:
    """Whether ``dequantised`` is ``original`` rounded to e4m3 in its block's scale: relative error at most 2^-4
    (3 mantissa bits), absolute at most half the smallest subnormal (2^-10) times the scale."""
    rows, cols = original.shape
    full = scale.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)[:rows, :cols]
    bound = original.float().abs() * 2**-4 + full * 2**-10
    return bool(((dequantised - original.float()).abs() <= bound).all())


def fp8_checkpoint(
    path: Path, seed: int = 0, block: tuple[int, int] = (128, 128), config_block: Any = "same", **overrides: Any
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A tiny DeepSeek-V3 written to ``path`` with its linears quantised by ``block`` and ``config.json``'s
    ``quantization_config`` naming ``config_block`` (``"same"``: ``block``; None: no quantization_config).

    Returns:
        ``(original, files)``: the high-precision weights of the quantised keys, and every tensor of the files.
    """
    model = tiny_model("deepseek_v3", seed, **{**DEEPSEEK_FP8, **overrides})
    model.save_pretrained(path)
    from safetensors.torch import load_file, save_file

    files = load_file(path / "model.safetensors")
    original = {k: v for k, v in files.items() if QUANTISED.match(k)}
    for key, weight in original.items():
        files[key], files[key + "_scale_inv"] = quantise(weight, block)
    save_file(files, str(path / "model.safetensors"), metadata={"format": "pt"})
    if config_block is not None:
        config = json.loads((path / "config.json").read_text())
        size = list(block) if config_block == "same" else config_block
        config["quantization_config"] = {
            "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": size, "activation_scheme": "dynamic"
        }  # fmt: skip
        (path / "config.json").write_text(json.dumps(config))
    return original, files


def expected_state(files: dict[str, torch.Tensor], block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The files' tensors in float32 with every FP8 weight dequantised and the scales dropped."""
    out = {}
    for key, value in files.items():
        if key.endswith("_scale_inv"):
            continue
        scale = files.get(key + "_scale_inv")
        out[key] = value.float() if scale is None else dequantise(value, scale, block)
    return out
