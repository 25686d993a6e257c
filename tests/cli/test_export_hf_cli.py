"""``lightning-moe-overlap export-hf``: a sharded checkpoint written by a fit of the HF demo module becomes a Hugging
Face folder that ``from_pretrained`` loads with no missing or unexpected key; errors end with the message, no
traceback. Oracle: the strategy's live ``full_state_dict()`` of that run, and transformers' loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from lightning_moe_overlap.cli import main
from tests.helpers.distributed import run_distributed

PROG = "lightning-moe-overlap export-hf: error: "


def _fit_and_save(rank: int, world: int, root: Path) -> dict:
    from lightning.pytorch import Trainer

    from lightning_moe_overlap import MoEOverlapStrategy
    from lightning_moe_overlap.demo_hf import HFMoECausalLM

    model = HFMoECausalLM("mixtral")
    model.model.config.save_pretrained(root / "config")
    trainer = Trainer(
        accelerator="cpu", devices=world, max_steps=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0,
        strategy=MoEOverlapStrategy(ep=1, num_microbatches=1),
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader(torch.randint(0, 128, (4, 8)), batch_size=2))
    trainer.save_checkpoint(root / "sharded.ckpt")  # the default format: a sharded directory
    return trainer.strategy.full_state_dict()


def _main(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(["export-hf", *args])
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("fit")
    return root, run_distributed(_fit_and_save, 1, root, timeout_s=240)[0]


def test_a_checkpoint_exports_to_a_folder_from_pretrained_loads(checkpoint, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    root, full = checkpoint
    dst = tmp_path / "hf"
    code, out, err = _main(capsys, str(root / "sharded.ckpt"), str(dst), "--config", str(root / "config"),
                           "--max-shard-size", "30KB")  # fmt: skip
    assert code == 0, err
    assert f'"to": "{dst}"' in out and "model-00001-of-" in out
    loaded, info = AutoModelForCausalLM.from_pretrained(dst, output_loading_info=True)
    capsys.readouterr()  # transformers' progress bar
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() and info["mismatched_keys"] == set()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, full[f"model.{name}"]), name
    code, _, err = _main(capsys, str(root / "sharded.ckpt"), str(dst), "--config", str(root / "config"))
    assert code == 1 and err.startswith(PROG) and "is not empty" in err and "Traceback" not in err, err
    code, _, err = _main(capsys, str(root / "sharded.ckpt"), str(dst), "--config", str(root / "config"), "--overwrite")
    assert code == 0, err
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize(
    "case,match",
    [
        ("missing", r"no checkpoint at|cannot be read"),
        ("size", r"is not a positive size"),
        ("prefix", r"no key starts with"),
    ],
)
def test_errors_print_the_message_and_exit_1(checkpoint, tmp_path, capsys, case, match):
    root, _ = checkpoint
    source = str(tmp_path / "missing") if case == "missing" else str(root / "sharded.ckpt")
    extra = {"size": ["--max-shard-size", "lots"], "prefix": ["--prefix", "net."]}.get(case, [])
    code, _, err = _main(capsys, source, str(tmp_path / "out"), "--config", str(root / "config"), *extra)
    assert code == 1 and err.startswith(PROG) and "Traceback" not in err, err
    assert __import__("re").search(match, err), err
    assert not (tmp_path / "out").exists()


def test_bad_arguments_exit_with_the_usage(capsys):
    code, _, err = _main(capsys, "only-one")
    assert code == 2 and "usage: lightning-moe-overlap export-hf" in err


@pytest.mark.long
def test_torchrun_writes_the_same_folder_from_a_directory_in_parts_and_from_a_file(checkpoint, tmp_path, capsys):
    import json
    import subprocess
    import sys

    root, _ = checkpoint
    whole = tmp_path / "one"
    assert _main(capsys, str(root / "sharded.ckpt"), str(whole), "--config", str(root / "config"),
                 "--max-shard-size", "30KB")[0] == 0  # fmt: skip
    from safetensors.torch import load_file

    from lightning_moe_overlap.checkpoint.consolidated import consolidate_checkpoint

    def tensors(folder: Path) -> dict:
        return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}

    consolidated = consolidate_checkpoint(root / "sharded.ckpt", tmp_path / "whole.ckpt")
    for source, dst in ((root / "sharded.ckpt", tmp_path / "two"), (consolidated, tmp_path / "file")):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                   "lightning_moe_overlap", "export-hf", str(source), str(dst), "--config", str(root / "config"),
                   "--max-shard-size", "30KB"]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        printed = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        assert len(printed) == 1 and printed[0]["to"] == str(dst)  # rank 0 prints
        one, two = tensors(whole), tensors(dst)
        assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one), source
        assert sorted(p.name for p in whole.iterdir()) == sorted(p.name for p in dst.iterdir())
