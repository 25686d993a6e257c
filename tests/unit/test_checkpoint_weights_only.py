"""Loading a checkpoint runs no code from it: every file is read weights-only unless the caller opts out.

Each test plants a pickle whose unpickling would create a marker file (``tests/helpers/planted.py``) into one file
of a checkpoint (``meta.pt``, a consolidated file, DCP's ``.metadata``, a DCP entry, an RNG state) and checks that the
default load
refuses it with the file's name and the opt-out while the marker does not exist. The same load with
``weights_only=False`` creates the marker: the planted pickle is live, so its absence proves nothing ran.
Checkpoints of the previous writer (RNG states with a NumPy array) and of format version 1 still load
weights-only; the oracle for their content is ``torch.load(weights_only=False)`` of the same bytes.
"""

from __future__ import annotations

import io
import pickle
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_moe_overlap.checkpoint import checkpointer, consolidate_checkpoint, load_consolidated_state_dict
from lightning_moe_overlap.checkpoint.safe_load import resolve
from lightning_moe_overlap.checkpoint.rng_state import capture_rng, read_rng, restore_rng
from lightning_moe_overlap.checkpoint.sharded import load_everything, single_process_quiet
from tests.unit.test_checkpoint import FIXTURE, _lightning_checkpoint, _trained
from tests.helpers.planted import Planted

OPT_OUT = r"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1.*weights_only=False"


@dataclass
class UserConfig:  # a hyper-parameter of a type no weights-only load knows
    width: int = 8


@pytest.fixture
def torch_default_globals():
    """Call it to keep only torch's own allow-list for the rest of the test (restored after): libraries the
    model's first forward imports (Megatron-Core) register more types, NumPy arrays among them, for the whole
    process with ``add_safe_globals``."""
    registered: list = []

    def reset() -> None:
        registered.extend(torch.serialization.get_safe_globals())
        torch.serialization.clear_safe_globals()

    yield reset
    torch.serialization.add_safe_globals(registered)


def _saved(tmp_path: Path, fmt: str = "sharded") -> tuple[Path, torch.nn.Module, torch.optim.Optimizer]:
    model, opt = _trained(seed=0)
    path = tmp_path / "ck"
    checkpointer.save(_lightning_checkpoint(model, opt), path, fmt, model, [opt], None)
    fresh, fresh_opt = _trained(seed=1)
    return path, fresh, fresh_opt


def _replace_dcp_entry(path: Path, key: str, value) -> None:
    """Rewrite the DCP part of ``path`` with ``key`` set to ``value`` (a forged DCP entry)."""
    flat = load_everything(path, weights_only=True)
    flat[key] = value
    for f in [*path.glob("*.distcp"), path / ".metadata"]:
        f.unlink()
    with single_process_quiet():
        dcp.save(flat, checkpoint_id=path, no_dist=True)


# -- every file of a checkpoint, planted ----------------------------------------------------------------------
def test_a_planted_meta_file_is_refused_naming_it_and_nothing_runs(tmp_path):
    path, model, opt = _saved(tmp_path)
    meta = torch.load(path / "meta.pt", weights_only=True)
    marker = tmp_path / "ran"
    torch.save({**meta, "planted": Planted(marker)}, path / "meta.pt")
    with pytest.raises(ValueError, match=rf"the checkpoint file {path / 'meta.pt'} holds .*_plant.*{OPT_OUT}"):
        checkpointer.load(path, model, [opt])
    with pytest.raises(ValueError, match=r"meta\.pt holds"):
        checkpointer.load(path, model, [opt], weights_only=None)  # Lightning's default: safe
    assert not marker.exists()
    checkpointer.load(path, model, [opt], weights_only=False)  # the opt-out unpickles it: the plant is live
    assert marker.exists()


def test_a_planted_consolidated_file_is_refused_naming_it_and_nothing_runs(tmp_path):
    path, model, opt = _saved(tmp_path, "consolidated")
    full = torch.load(path, weights_only=True)
    marker = tmp_path / "ran"
    torch.save({**full, "planted": Planted(marker)}, path)
    with pytest.raises(ValueError, match=rf"the checkpoint file {path} holds .*_plant.*{OPT_OUT}"):
        checkpointer.load(path, model, [opt])
    with pytest.raises(ValueError, match=rf"the checkpoint file {path} holds"):
        load_consolidated_state_dict(path)
    assert not marker.exists()
    checkpointer.load(path, model, [opt], weights_only=False)
    assert marker.exists()


def test_a_planted_dcp_metadata_file_is_refused_naming_it_and_nothing_runs(tmp_path):
    path, model, opt = _saved(tmp_path)
    marker = tmp_path / "ran"
    with open(path / ".metadata", "wb") as f:
        pickle.dump(Planted(marker), f)
    with pytest.raises(ValueError, match=rf"the DCP metadata file {path / '.metadata'} holds .*_plant.*{OPT_OUT}"):
        checkpointer.load(path, model, [opt])
    with pytest.raises(ValueError, match=r"\.metadata holds"):
        consolidate_checkpoint(path, tmp_path / "full.ckpt")
    assert not marker.exists()


def test_a_planted_dcp_entry_is_refused_naming_it_and_nothing_runs(tmp_path):
    path, model, opt = _saved(tmp_path)
    marker = tmp_path / "ran"
    _replace_dcp_entry(path, "rng.rank_0", Planted(marker))
    with pytest.raises(ValueError, match=rf"the entry `rng\.rank_0` of the DCP checkpoint {path} holds .*{OPT_OUT}"):
        checkpointer.load(path, model, [opt], restore_rng_state=True)
    assert not marker.exists()


def test_a_planted_rng_state_is_refused_naming_it_and_nothing_runs(tmp_path):
    path, model, opt = _saved(tmp_path)
    marker = tmp_path / "ran"
    blob = io.BytesIO()
    torch.save({"python": Planted(marker)}, blob)
    _replace_dcp_entry(path, "rng.rank_0", blob.getvalue())
    with pytest.raises(ValueError, match=rf"the RNG state of rank 0 in {path} holds .*_plant.*{OPT_OUT}"):
        checkpointer.load(path, model, [opt], restore_rng_state=True)
    assert not marker.exists()


# -- what this package writes loads weights-only --------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["sharded", "consolidated"])
def test_every_file_written_loads_with_torch_weights_only(tmp_path, fmt, torch_default_globals):
    path, model, opt = _saved(tmp_path, fmt)
    torch_default_globals()  # after the save: the model's first forward imports Megatron-Core
    files = [path / "meta.pt"] if fmt == "sharded" else [path]
    assert all(torch.serialization.get_unsafe_globals_in_checkpoint(f) == [] for f in files)
    if fmt == "sharded":
        flat = load_everything(path, weights_only=True)
        blob = flat["rng.rank_0"]
    else:
        blob = torch.load(path, weights_only=True)["moe_checkpoint"]["rng_states"][0]
    assert torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(blob)) == []
    loaded = checkpointer.load(path, model, [opt], restore_rng_state=True)
    assert (loaded["epoch"], loaded["global_step"]) == (1, 2)


def test_rng_state_round_trips_every_generator(tmp_path):
    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    blob = capture_rng()
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    restore_rng(read_rng(blob, "rng", weights_only=True))
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected


# -- earlier checkpoints ----------------------------------------------------------------------------------------
def _old_rng_blob() -> bytes:
    """An RNG state as the previous writer saved it: NumPy's state with its key array."""
    states = {"python": random.getstate(), "torch": torch.get_rng_state(), "numpy": np.random.get_state()}
    buffer = io.BytesIO()
    torch.save(states, buffer)
    return buffer.getvalue()


def test_a_checkpoint_of_the_previous_writer_restores_its_rng_weights_only(tmp_path, torch_default_globals):
    path, model, opt = _saved(tmp_path)
    torch_default_globals()
    np.random.seed(7)
    blob = _old_rng_blob()
    expected = np.random.rand(4)
    assert torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(blob))  # needs NumPy's globals
    _replace_dcp_entry(path, "rng.rank_0", blob)
    np.random.seed(0)
    checkpointer.load(path, model, [opt], restore_rng_state=True)
    assert np.array_equal(np.random.rand(4), expected)


def test_the_version_1_fixtures_rng_states_read_weights_only_as_unrestricted(torch_default_globals):
    torch_default_globals()
    flat = load_everything(Path(FIXTURE) / "checkpoint", weights_only=True)
    blobs = [flat[f"rng/rank_{r}"] for r in range(2)]
    for r, blob in enumerate(blobs):
        safe = read_rng(blob, f"rank {r}", weights_only=True)
        oracle = torch.load(io.BytesIO(blob), weights_only=False)
        assert safe["python"] == oracle["python"] and torch.equal(safe["torch"], oracle["torch"])
        assert safe["numpy"][0] == oracle["numpy"][0] and np.array_equal(safe["numpy"][1], oracle["numpy"][1])


# -- types beyond plain data: the opt-out and the allow-list --------------------------------------------------
def test_a_hyper_parameter_of_a_user_type_needs_the_opt_out_or_an_allow_list(tmp_path):
    path, model, opt = _saved(tmp_path)
    meta = torch.load(path / "meta.pt", weights_only=True)
    torch.save({**meta, "hyper_parameters": {"config": UserConfig()}}, path / "meta.pt")
    with pytest.raises(ValueError, match=rf"meta\.pt holds objects of \[.*UserConfig'\].*add_safe_globals.*{OPT_OUT}"):
        checkpointer.load(path, model, [opt])
    with torch.serialization.safe_globals([UserConfig]):
        loaded = checkpointer.load(path, model, [opt])
    assert loaded["hyper_parameters"]["config"] == UserConfig()
    assert checkpointer.load(path, model, [opt], weights_only=False)["hyper_parameters"]["config"] == UserConfig()



@pytest.mark.parametrize(
    "env,argument,expected",
    [
        ({}, None, True),
        ({}, False, False),
        ({"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}, None, False),
        ({"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}, True, True),
        ({"TORCH_FORCE_WEIGHTS_ONLY_LOAD": "true"}, False, True),
    ],
)
def test_weights_only_is_decided_as_torch_load_decides_it(monkeypatch, env, argument, expected):
    for name in ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert resolve(argument) is expected


def test_the_environment_opt_out_reaches_the_loader(tmp_path, monkeypatch):
    path, model, opt = _saved(tmp_path)
    meta = torch.load(path / "meta.pt", weights_only=True)
    marker = tmp_path / "ran"
    torch.save({**meta, "planted": Planted(marker)}, path / "meta.pt")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    checkpointer.load(path, model, [opt])
    assert marker.exists()


def test_reading_an_rng_state_keeps_the_types_registered_before(torch_default_globals):
    torch_default_globals()
    torch.serialization.add_safe_globals([np.ndarray, np.dtype])
    read_rng(_old_rng_blob(), "rng", weights_only=True)
    assert {np.ndarray, np.dtype} <= set(torch.serialization.get_safe_globals())
