"""``lightning-moe-overlap consolidate-checkpoint``: a sharded directory written by a 2-process fit at ep=2 becomes
one file; a source it cannot read ends with the message, no traceback.

Oracle: the strategy's live ``full_state_dict()`` of that run (gathered from the ranks, not read from the files)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.cli import main
from lightning_moe_overlap.demo import MoEGPT, SyntheticTokens
from tests.helpers.distributed import run_distributed

PROG = "lightning-moe-overlap consolidate-checkpoint: error: "


def _fit_and_save(rank: int, world: int, root: Path) -> dict | None:
    torch.set_num_threads(1)
    model = MoEGPT(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_experts=4, ffn_hidden_size=8)
    trainer = Trainer(
        accelerator="cpu", devices=world, max_steps=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0,
        strategy=MoEOverlapStrategy(ep=2, num_microbatches=2),
    )
    trainer.fit(model, datamodule=SyntheticTokens(vocab_size=32, seq_len=8, batch_size=4, num_samples=16))
    trainer.save_checkpoint(root / "sharded.ckpt")  # the default format: a sharded directory
    return trainer.strategy.full_state_dict()  # rank 0 only


def _main(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(["consolidate-checkpoint", *args])
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def test_a_two_process_checkpoint_consolidates_into_the_runs_full_state(tmp_path, capsys):
    full = run_distributed(_fit_and_save, 2, tmp_path, timeout_s=240)[0]
    assert (tmp_path / "sharded.ckpt").is_dir()
    code, out, err = _main(capsys, str(tmp_path / "sharded.ckpt"), str(tmp_path / "one.ckpt"))
    assert code == 0, err
    assert f'"to": "{tmp_path / "one.ckpt"}"' in out
    written = torch.load(tmp_path / "one.ckpt", weights_only=True)["state_dict"]
    assert written.keys() == full.keys()
    for name, tensor in full.items():
        assert torch.equal(written[name], tensor), name
    assert written["layers.0.mlp.experts.gate_up_proj"].shape[0] == 4  # every expert, from both ranks

    torch.save({"state_dict": {}}, tmp_path / "one.ckpt")  # an existing destination is kept ...
    code, _, err = _main(capsys, str(tmp_path / "sharded.ckpt"), str(tmp_path / "one.ckpt"))
    assert code == 1 and "exists; writing would replace it. Pass --overwrite" in err, err
    assert torch.load(tmp_path / "one.ckpt", weights_only=True)["state_dict"] == {}
    code, _, err = _main(capsys, str(tmp_path / "sharded.ckpt"), str(tmp_path / "one.ckpt"), "--overwrite")
    assert code == 0, err  # ... unless replacing it is asked for
    assert torch.load(tmp_path / "one.ckpt", weights_only=True)["state_dict"].keys() == full.keys()


@pytest.mark.parametrize(
    "case,match",
    [
        ("missing", r"no checkpoint at .*missing\. Check the path\."),
        ("file", r"is a file, not a sharded checkpoint directory; a file is already consolidated"),
        ("incomplete", r"is incomplete: it has no `COMMIT` marker"),
        ("url", r"is a URL"),
    ],
)
def test_a_source_it_cannot_read_prints_the_message_and_exits_1(tmp_path, capsys, case, match):
    source = {"missing": tmp_path / "missing", "file": tmp_path / "one.ckpt", "incomplete": tmp_path / "dir"}.get(
        case, "s3://bucket/ck"
    )
    if case == "file":
        torch.save({"state_dict": {}}, source)
    elif case == "incomplete":
        source.mkdir()
    code, _, err = _main(capsys, str(source), str(tmp_path / "out.ckpt"))
    assert code == 1 and err.startswith(PROG) and "Traceback" not in err, err
    assert __import__("re").search(match, err), err
    assert not (tmp_path / "out.ckpt").exists()


def test_a_directory_as_destination_is_refused(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    code, _, err = _main(capsys, str(tmp_path / "src"), str(tmp_path))
    assert code == 1 and "is a directory; the consolidated checkpoint is one file" in err, err


def test_bad_arguments_exit_with_the_usage(capsys):
    code, _, err = _main(capsys, "only-one")
    assert code == 2 and "usage: lightning-moe-overlap consolidate-checkpoint" in err
    code, out, _ = _main(capsys, "--help")
    assert code == 0 and "--no-weights-only" in out
