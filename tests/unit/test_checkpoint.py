"""Checkpoint building blocks in one process: layout-free keys, optimizer state, atomic commit, both formats.

The distributed behaviour (exact resume, resharding across ep sizes, export) is in
tests/distributed/test_checkpoint_strategy.py; here every conversion is checked against a plain oracle and every
error message against its rule.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.checkpoint import atomic, checkpointer, consolidate_checkpoint, load_consolidated_state_dict
from lightning_moe_overlap.checkpoint.consolidated import read_file
from lightning_moe_overlap.checkpoint.fit_checks import (
    check_expert_counts,
    check_keys,
    check_optimizer,
    check_state_names,
)
from lightning_moe_overlap.checkpoint.optimizer import (
    flat_to_named,
    indexed_to_flat,
    named_groups,
    param_names,
    to_indexed,
)
from lightning_moe_overlap.moe.ep import apply_expert_parallel
from lightning_moe_overlap.moe.layer import MoELayer

E = 4  # experts


class Tiny(nn.Module):
    def __init__(self, seed: int = 0, num_experts: int = E) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.proj = nn.Linear(8, 8)
        self.moe = MoELayer(hidden_size=8, ffn_hidden_size=4, num_experts=num_experts, top_k=2)

    def forward(self, x):
        return self.moe(self.proj(x))


def _trained(seed: int = 0, steps: int = 2, ep_wrap: bool = True) -> tuple[Tiny, torch.optim.Optimizer]:
    model = Tiny(seed)
    if ep_wrap:
        apply_expert_parallel(model, None)  # ep=1: one rank holds every expert
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(1, 6, 8, generator=torch.Generator().manual_seed(seed))).square().mean().backward()
        opt.step()
    return model, opt


def _lightning_checkpoint(model, opt) -> dict:
    return {
        "epoch": 1,
        "global_step": 2,
        "state_dict": checkpointer.module_state(model),
        "optimizer_states": [checkpointer.optimizer_state(opt, model)],
    }


# -- checks and conversions -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call,match",
    [
        (
            lambda: check_expert_counts({"w": (8, 2)}, {"w": 4}, "ck"),
            r"the checkpoint at ck holds 8 experts for `w` but the model has 4\. A checkpoint loads at any ep",
        ),
        (
            lambda: check_keys({"a": (2,)}, {"a": (3,)}, "ck", strict=False),
            r"1 tensors differ in shape \(a: saved \(2,\), model \(3,\)\)",
        ),
        (
            lambda: check_keys({"a": (2,), "z": (1,)}, {"a": (2,), "b": (1,)}, "ck", strict=True),
            r"different model: 1 keys of the model are not in it \['b'\], 1 saved keys are not in the model \['z'\]",
        ),
        (
            lambda: check_optimizer({"a"}, {"a", "b"}, {"a", "b"}, "ck"),
            r"saved for other parameters: 1 of the optimizer's are not in it \['b'\]",
        ),
        (
            lambda: check_optimizer({"a", "c"}, {"a"}, {"a", "c"}, "ck"),
            r"1 saved ones are not in the optimizer \['c'\]",
        ),
        (
            lambda: check_state_names({"state.a.momentum_buffer"}, {"state.a.exp_avg"}, "ck"),
            r"lacks 1 entries the optimizer keeps \['state.a.exp_avg'\]: it was saved by another optimizer",
        ),
        (
            lambda: indexed_to_flat({"state": {}, "param_groups": [{"params": [0]}]}, ["a", "b"], "ck"),
            r"has 1 parameters but the optimizer has 2; a file that does not name its parameters",
        ),
    ],
)
def test_check_errors_name_the_values_the_rule_and_the_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_partial_matches_pass_the_checks():
    check_keys({"a": (2,), "z": (1,)}, {"a": (2,), "b": (1,)}, "ck", strict=False)
    check_optimizer({"a", "c"}, {"a"}, {"a"}, "ck")  # `c` is held by another pipeline rank


def test_optimizer_state_round_trips_between_the_indexed_and_the_flat_form():
    model, opt = _trained(ep_wrap=False)
    osd = opt.state_dict()
    names = param_names(opt, model)
    flat = indexed_to_flat(osd, names, "ck")
    api = checkpointer.optimizer_state(opt, model)  # the state-dict API's own flat form
    assert flat.keys() == api.keys()
    assert all(torch.equal(v, api[k]) if isinstance(v, torch.Tensor) else v == api[k] for k, v in flat.items())
    groups = named_groups(opt, model)
    back = to_indexed(flat_to_named(flat, groups), groups)
    assert back["param_groups"] == osd["param_groups"] and back["state"].keys() == osd["state"].keys()
    for i, entry in osd["state"].items():
        assert all(torch.equal(back["state"][i][k], v) for k, v in entry.items())
    with pytest.raises(ValueError, match=r"holds a parameter of shape \(3,\) that is not a parameter of the"):
        param_names(torch.optim.SGD([nn.Parameter(torch.ones(3))], lr=1.0), model)


def test_model_state_is_keyed_by_the_unsplit_names_with_every_expert():
    model, _ = _trained()
    state = checkpointer.module_state(model)
    assert list(state) == list(Tiny().state_dict())
    assert state["moe.experts.gate_up_proj"].shape[0] == E


# -- both formats end to end, one process ----------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["sharded", "consolidated"])
def test_save_then_load_restores_model_and_optimizer_bitwise(tmp_path, fmt):
    model, opt = _trained(seed=0)
    path = tmp_path / "ck"
    checkpointer.save(_lightning_checkpoint(model, opt), path, fmt, model, [opt], None)
    assert path.is_dir() == (fmt == "sharded") and not list(tmp_path.glob("*.partial-*"))
    fresh, fresh_opt = _trained(seed=1)
    loaded = checkpointer.load(path, fresh, [fresh_opt], restore_rng_state=True)
    assert (loaded["epoch"], loaded["global_step"]) == (1, 2)
    checkpointer.load_module_state(fresh, loaded, strict=True)
    checkpointer.load_optimizer_states([fresh_opt], fresh, loaded)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert all(torch.equal(v, fresh_opt.state[q][k]) for k, v in opt.state[p].items())
    full = load_consolidated_state_dict(path, prefix="moe.")  # the unsharded names, the prefix removed
    assert full["experts.gate_up_proj"].shape[0] == E and "proj.weight" not in full


def test_optimizer_state_unwraps_lightnings_optimizer_wrapper():
    from lightning.pytorch.core.optimizer import LightningOptimizer

    model, opt = _trained(seed=0)
    state = checkpointer.optimizer_state(opt, model)
    wrapped = checkpointer.optimizer_state(LightningOptimizer(opt), model)
    assert wrapped.keys() == state.keys()
    assert all(torch.equal(v, wrapped[k]) if isinstance(v, torch.Tensor) else v == wrapped[k] for k, v in state.items())
    fresh, fresh_opt = _trained(seed=1)
    checkpointer.load_optimizer_states([LightningOptimizer(fresh_opt)], fresh, {"optimizer_states": [state]})
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert all(torch.equal(v, fresh_opt.state[q][k]) for k, v in opt.state[p].items())


def test_sharded_checkpoint_consolidates_offline_into_the_unsharded_model(tmp_path):
    model, opt = _trained(seed=0)
    checkpointer.save(_lightning_checkpoint(model, opt), tmp_path / "ck", "sharded", model, [opt], None)
    out = torch.load(consolidate_checkpoint(tmp_path / "ck", tmp_path / "full.ckpt"), weights_only=False)
    plain = Tiny(seed=1)  # no expert parallelism at all
    plain.load_state_dict(out["state_dict"], strict=True)
    x = torch.randn(1, 5, 8)
    torch.testing.assert_close(plain(x), model(x))
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    plain_opt.load_state_dict(out["optimizer_states"][0])  # the plain optimizer format


def test_loading_a_checkpoint_with_another_expert_count_is_refused(tmp_path):
    model, opt = _trained()
    checkpointer.save(_lightning_checkpoint(model, opt), tmp_path / "ck", "sharded", model, [opt], None)
    other = Tiny(num_experts=2)
    apply_expert_parallel(other, None)
    with pytest.raises(ValueError, match=r"holds 4 experts for `moe.experts.gate_up_proj` but the model has 2"):
        checkpointer.load(tmp_path / "ck", other, [])


# -- atomicity -------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not hasattr(os, "fork"), reason="Requires: os.fork to kill a save midway")
def test_save_killed_before_commit_leaves_a_checkpoint_that_is_refused(tmp_path):
    model, opt = _trained()
    checkpoint = _lightning_checkpoint(model, opt)
    pid = os.fork()
    if pid == 0:  # the child is killed (no cleanup runs) after writing every tensor, before the commit
        try:
            atomic.write_marker = lambda *args: os._exit(17)
            checkpointer.save(checkpoint, tmp_path / "ck", "sharded", model, [opt], None)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 17
    assert not (tmp_path / "ck").exists()  # the final name never appears
    (partial,) = tmp_path.glob("ck.partial-*")
    assert (partial / ".metadata").is_file()  # the data is all there, but not committed
    with pytest.raises(RuntimeError, match=r"is incomplete: it has no `COMMIT` marker, so the save that wrote it did"):
        checkpointer.load(partial, model, [opt])
    partial.rename(tmp_path / "renamed")  # a copied or renamed directory is refused the same way
    with pytest.raises(RuntimeError, match=r"no `COMMIT` marker.*Resume from an earlier checkpoint"):
        checkpointer.load(tmp_path / "renamed", model, [opt])


def test_replacing_a_checkpoint_keeps_a_complete_one_and_cleans_up(tmp_path):
    model, opt = _trained()
    for _ in range(2):  # `last.ckpt` style: the same name saved twice
        checkpointer.save(_lightning_checkpoint(model, opt), tmp_path / "last.ckpt", "sharded", model, [opt], None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    checkpointer.remove(tmp_path / "last.ckpt", rank=0)
    assert not list(tmp_path.iterdir())


def test_consolidated_staging_or_truncated_files_are_refused(tmp_path):
    model, opt = _trained()
    checkpointer.save(_lightning_checkpoint(model, opt), tmp_path / "full.ckpt", "consolidated", model, [opt], None)
    data = (tmp_path / "full.ckpt").read_bytes()
    (tmp_path / "full.ckpt.partial-ab").write_bytes(data)
    with pytest.raises(RuntimeError, match=r"is the staging file of a save that was not committed"):
        checkpointer.load(tmp_path / "full.ckpt.partial-ab", model, [opt])
    (tmp_path / "cut.ckpt").write_bytes(data[: len(data) // 2])
    with pytest.raises(RuntimeError, match=r"cannot be read .*; it is truncated or not a torch checkpoint"):
        read_file(tmp_path / "cut.ckpt")


def test_path_and_format_errors(tmp_path):
    model, opt = _trained()
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at .*missing\. Check the path"):
        checkpointer.load(tmp_path / "missing", model, [opt])
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at .*gone\. Check the path"):
        atomic.read_marker(tmp_path / "gone")
    (tmp_path / "last.ckpt").symlink_to(tmp_path / "epoch=0-step=9.ckpt")  # a link to a save never committed
    with pytest.raises(FileNotFoundError, match=r"last\.ckpt links to .*step=9\.ckpt, which does not exist: the save "
                                                r"it links to was not committed.*Resume from an earlier checkpoint"):
        checkpointer.load(tmp_path / "last.ckpt", model, [opt])
    with pytest.raises(NotImplementedError, match=r"'s3://b/ck' is a URL; expert-parallel checkpoints are written"):
        checkpointer.load("s3://b/ck", model, [opt])
    with pytest.raises(ValueError, match=r"`checkpoint_format='zip'` is not one of \['sharded', 'consolidated'\]"):
        MoEOverlapStrategy(checkpoint_format="zip", num_microbatches=2)
    with pytest.raises(TypeError, match=r"`storage_options=\{'a': 1\}` is not supported"):
        MoEOverlapStrategy(num_microbatches=2).save_checkpoint({}, tmp_path / "x", storage_options={"a": 1})


def test_strategy_restores_after_setup_and_takes_the_format_argument():
    strategy = MoEOverlapStrategy(num_microbatches=2, checkpoint_format="consolidated")
    assert strategy.restore_checkpoint_after_setup and strategy.checkpoint_format == "consolidated"
    assert MoEOverlapStrategy(num_microbatches=2).checkpoint_format == "sharded"


def test_rng_state_is_restored_with_the_checkpoint(tmp_path):
    model, opt = _trained()
    checkpointer.save(_lightning_checkpoint(model, opt), tmp_path / "ck", "sharded", model, [opt], None)
    expected = torch.rand(3)
    checkpointer.load(tmp_path / "ck", model, [opt], restore_rng_state=True)
    assert torch.equal(torch.rand(3), expected)


# -- format version 1 (per-expert keys) ------------------------------------------------------------------------
FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "legacy_v1")


def _fixture_model(seed: int):
    from lightning_moe_overlap.demo import MoEGPT

    expected = torch.load(os.path.join(FIXTURE, "expected.pt"), weights_only=False)
    model = MoEGPT(**expected["config"], seed=seed)
    apply_expert_parallel(model, None)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), expected


def test_a_version_1_directory_is_refused_with_the_converter_named(tmp_path):
    model, opt, _ = _fixture_model(1)
    with pytest.raises(ValueError, match=r"has format version 1 \(per-expert keys.*convert-checkpoint .* NEW_PATH"):
        checkpointer.load(os.path.join(FIXTURE, "checkpoint"), model, [opt])


def test_a_version_1_directory_converts_and_loads_bitwise(tmp_path):
    """The fixture was written at ep=2 by 2 ranks in format version 1; converted, it loads at ep=1."""
    from lightning_moe_overlap.checkpoint import convert_legacy_checkpoint
    from lightning_moe_overlap.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["convert-checkpoint", os.path.join(FIXTURE, "checkpoint"), str(tmp_path / "v2")])
    assert exit_info.value.code == 0
    model, opt, expected = _fixture_model(1)
    loaded = checkpointer.load(tmp_path / "v2", model, [opt])
    assert (loaded["epoch"], loaded["global_step"]) == (1, 2)
    checkpointer.load_module_state(model, loaded, strict=True)
    checkpointer.load_optimizer_states([opt], model, loaded)
    assert list(model.state_dict()) == list(expected["state_dict"])
    assert all(torch.equal(v, expected["state_dict"][k]) for k, v in model.state_dict().items())
    got, want = opt.state_dict(), expected["optimizer"]
    assert got["param_groups"] == want["param_groups"] and got["state"].keys() == want["state"].keys()
    for i, entry in want["state"].items():
        assert all(torch.equal(got["state"][i][k], v) for k, v in entry.items())
    offline_path = consolidate_checkpoint(os.path.join(FIXTURE, "checkpoint"), tmp_path / "f.ckpt")
    offline = torch.load(offline_path, weights_only=False)
    assert all(torch.equal(offline["state_dict"][k], v) for k, v in expected["state_dict"].items())
    with pytest.raises(ValueError, match=r"is not a version-1 sharded checkpoint .*version 2"):
        convert_legacy_checkpoint(tmp_path / "v2", tmp_path / "v3")


@pytest.mark.parametrize("fmt", ["sharded", "consolidated"])
def test_a_checkpoint_without_optimizer_state_loads_the_model_only(tmp_path, fmt):
    model, opt = _trained(seed=0)
    checkpoint = _lightning_checkpoint(model, opt)
    del checkpoint["optimizer_states"]  # `save_checkpoint(weights_only=True)`
    checkpointer.save(checkpoint, tmp_path / "ck", fmt, model, [opt], None)
    fresh, fresh_opt = _trained(seed=1)
    loaded = checkpointer.load(tmp_path / "ck", fresh, [fresh_opt])
    assert "optimizer_states" not in loaded  # Lightning then says the checkpoint holds the model only
    checkpointer.load_module_state(fresh, loaded, strict=True)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_saving_before_the_first_step_leaves_the_optimizer_without_state(tmp_path):
    model, opt = _trained(steps=0)
    checkpointer.save(_lightning_checkpoint(model, opt), tmp_path / "ck", "sharded", model, [opt], None)
    assert not opt.state  # the first real step stays the first (Adam's bias correction)
    fresh, fresh_opt = _trained(seed=1)  # has stepped: loading gives it the saved (empty) state
    loaded = checkpointer.load(tmp_path / "ck", fresh, [fresh_opt])
    checkpointer.load_optimizer_states([fresh_opt], fresh, loaded)
    assert not fresh_opt.state and fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
