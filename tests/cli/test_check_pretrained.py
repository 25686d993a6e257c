"""`check` on a config whose model starts from a published checkpoint (`model.init_args.pretrained`): the model is
built as the strategy builds it (``configure_model`` on the meta device), so its MoE blocks are seen, and the
checkpoint's headers are matched against it, reporting what the load at setup would refuse, before anything runs.
Oracle: the keys removed from the files by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from lightning_moe_overlap.cli import check_main

transformers = pytest.importorskip("transformers", reason="Requires: transformers>=5")
ROOT = Path(__file__).resolve().parents[2]


def _check(capsys, pretrained: Path) -> tuple[int, str]:
    code = check_main([
        "--config", str(ROOT / "examples" / "configs" / "cpu_hf_qwen3.yaml"),
        f"--model.init_args.pretrained={pretrained}", "--no-machine-checks",
    ])  # fmt: skip
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    return code, out.out


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from lightning_moe_overlap.demo_hf import build_hf_model

    path = tmp_path_factory.mktemp("qwen3")
    build_hf_model("qwen3_moe").save_pretrained(path)
    return path


def test_a_checkpoint_that_fits_passes_and_its_moe_blocks_are_seen(capsys, folder):
    code, out = _check(capsys, folder)
    assert code == 0 and "no-moe-blocks" not in out and out.strip().endswith("0 error(s), 0 warning(s)"), out


def test_a_missing_expert_is_named_before_anything_runs(capsys, folder, tmp_path):
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    kept = {k: v for k, v in tensors.items() if ".layers.0.mlp.experts.6." not in k}
    save_file(kept, tmp_path / "model.safetensors", metadata={"format": "pt"})
    code, out = _check(capsys, tmp_path)
    assert code == 1 and "[hf-weights] ValueError: `check`: the weights the model declares would not load" in out, out
    assert "model.layers.0.mlp.experts.{6}.gate_proj.weight" in out, out


def test_a_folder_that_does_not_exist_is_a_finding(capsys, tmp_path):
    code, out = _check(capsys, tmp_path / "nowhere")
    assert code == 1 and "[model]" in out and "does not exist" in out, out


def test_a_model_loaded_with_from_pretrained_in_configure_model_is_built_on_meta_and_checked(capsys, folder, tmp_path):
    import yaml

    config = yaml.safe_load((ROOT / "examples" / "configs" / "cpu_hf_qwen3.yaml").read_text())
    config["model"] = {"class_path": "tests.helpers.hf_checkpoints.LoadsInConfigureModel",
                       "init_args": {"folder": str(folder)}}  # fmt: skip
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    code = check_main(["--config", str(tmp_path / "config.yaml"), "--no-machine-checks"])
    out = capsys.readouterr().out
    assert code == 0 and "no-moe-blocks" not in out and out.strip().endswith("0 error(s), 0 warning(s)"), out
