"""``async_save``'s rules, and a background save in one process: what it writes is what a synchronous save writes,
the live tensors may change once it returns, and a failed write is raised with its cause and the fix."""

from __future__ import annotations

import threading
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch.distributed.checkpoint import FileSystemWriter

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.checkpoint import atomic
from lightning_moe_overlap.checkpoint.background import BackgroundSaves
from lightning_moe_overlap.checkpoint.checkpointer import save
from lightning_moe_overlap.checkpoint.sharded import read_all
from lightning_moe_overlap.checkpoint.state import model_state
from lightning_moe_overlap.demo import MoEGPT


def test_async_save_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match=r"`async_save=1` must be a bool \(True or False\)"):
        MoEOverlapStrategy(async_save=1)


def test_async_save_with_the_consolidated_format_warns_that_it_writes_before_returning() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        MoEOverlapStrategy(async_save=True, checkpoint_format="consolidated")
    text = " ".join(str(w.message) for w in caught)
    assert "only sharded saves are written in the background" in text and "checkpoint_format='sharded'" in text


def test_lightnings_async_checkpoint_io_turns_background_saves_on() -> None:
    assert not MoEOverlapStrategy().saves_in_background
    assert MoEOverlapStrategy(async_save=True).saves_in_background
    assert MoEOverlapStrategy(checkpoint_io=AsyncCheckpointIO()).saves_in_background


def _model() -> MoEGPT:
    return MoEGPT(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2, num_experts=2, ffn_hidden_size=8, seed=0)


def test_a_background_save_holds_the_values_of_its_moment(tmp_path: Path) -> None:
    model = _model()
    checkpoint = {"state_dict": model_state(model), "global_step": 3}
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    saves = BackgroundSaves(timeout=timedelta(minutes=1))
    save(checkpoint, tmp_path / "a.ckpt", "sharded", model, [], None, background=saves)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the next step, while the save is written
    saves.close()
    state, meta = read_all(tmp_path / "a.ckpt")
    assert meta["global_step"] == 3 and atomic.read_marker(tmp_path / "a.ckpt")["format"] == "sharded"
    assert state["model"].keys() == expected.keys()
    assert [k for k in expected if not torch.equal(state["model"][k], expected[k])] == []


def test_a_failed_background_save_is_raised_with_its_cause_and_nothing_is_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model()
    saves = BackgroundSaves(timeout=timedelta(minutes=1))

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full_disk)
    save({"state_dict": model_state(model)}, tmp_path / "b.ckpt", "sharded", model, [], None, background=saves)
    with pytest.raises(
        RuntimeError,
        match=r"a background checkpoint save failed \(.*No space left on device.*"
        r"the previous checkpoint is intact.*`async_save=False`",
    ):
        saves.wait()
    assert not (tmp_path / "b.ckpt").exists()
    assert [p.name for p in atomic.leftovers(tmp_path)] and not saves.in_flight
    saves.wait()  # raised once; nothing in flight now
    assert not [t for t in threading.enumerate() if t.name.startswith("moe-overlap-checkpoint")]  # none outlives
