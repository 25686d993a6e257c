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
from lightning_moe_overlap.checkpoint.keys import (
    canonical_to_full,
    check_expert_counts,
    check_keys,
    expert_key,
    from_canonical,
    full_to_canonical,
    split_key,
    to_canonical,
)
from lightning_moe_overlap.checkpoint.optimizer import (
    canonical_optimizer_to_full,
    check_groups,
    full_optimizer_to_canonical,
    optimizer_from_canonical,
    optimizer_to_canonical,
    param_names,
)
from lightning_moe_overlap.checkpoint.target import LoadTarget
from lightning_moe_overlap.moe.adapters import apply_expert_parallel
from lightning_moe_overlap.moe.ep import ExpertShard
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


def _shards(num_local: int, first: int, names=("moe.experts.gate_up_proj", "moe.experts.down_proj")) -> dict:
    return {n: ExpertShard(num_experts=E, first_expert=first, num_local=num_local) for n in names}


# -- keys ------------------------------------------------------------------------------------------------------
def test_expert_keys_round_trip_and_plain_names_stay():
    assert expert_key("a.b.w", 3) == "a.b.w[3]"
    assert split_key("a.b.w[3]") == ("a.b.w", 3)
    assert split_key("layers.0.weight") == ("layers.0.weight", None)


def test_model_state_split_by_two_ranks_recombines_to_the_full_state():
    full = Tiny().state_dict()
    merged = {}
    for rank in range(2):  # ep=2: rank r holds experts [2r, 2r+2)
        shards = _shards(2, 2 * rank)
        local = {k: (v[2 * rank : 2 * rank + 2] if k in shards else v) for k, v in full.items()}
        canonical = to_canonical(local, shards)
        assert canonical.keys() == full_to_canonical(full, shards).keys()
        assert all(torch.equal(from_canonical(canonical, shards)[k], v) for k, v in local.items())
        merged.update(canonical)
    recombined = canonical_to_full(merged)
    assert list(recombined) == list(full)  # the unsharded model's names, in its order
    assert all(torch.equal(recombined[k], v) for k, v in full.items())


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: from_canonical({"x.w[0]": torch.ones(1)}, {}), r"per-expert entries `x.w\[i\]` but the model has no"),
        (
            lambda: from_canonical({"m.down_proj[0]": torch.ones(1)}, _shards(2, 0, ["m.down_proj"])),
            r"lacks experts \[1\] of `m.down_proj`, which this rank holds",
        ),
        (lambda: canonical_to_full({"w[0]": torch.ones(1), "w[2]": torch.ones(1)}), r"lacks \[1\]; a consolidated"),
        (
            lambda: to_canonical({"w": torch.ones(3, 2)}, {"w": ExpertShard(4, 0, 2)}),
            r"`w` is \(3, 2\), but it is a per-expert tensor of a rank holding 2 local experts",
        ),
        (
            lambda: full_to_canonical({"w": torch.ones(8, 2)}, {"w": ExpertShard(4, 0, 2)}),
            r"`w` is \(8, 2\) but the model has 4 experts there",
        ),
        (
            lambda: check_expert_counts({"w": 8}, {"w": ExpertShard(4, 0, 2)}, "ck"),
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
    ],
)
def test_key_errors_name_the_values_the_rule_and_the_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_check_keys_without_strict_accepts_a_partial_match():
    check_keys({"a": (2,), "z": (1,)}, {"a": (2,), "b": (1,)}, "ck", strict=False)


# -- optimizer -------------------------------------------------------------------------------------------------
def test_optimizer_state_split_by_two_ranks_recombines_to_the_unsharded_state():
    model, opt = _trained(ep_wrap=False)
    full = opt.state_dict()
    names = param_names(opt, model)
    merged: dict = {"state": {}, "param_groups": None}
    for rank in range(2):
        shards = _shards(2, 2 * rank)
        local = {
            "state": {
                i: {k: (v[2 * rank : 2 * rank + 2] if names[i] in shards and v.dim() else v) for k, v in s.items()}
                for i, s in full["state"].items()
            },
            "param_groups": full["param_groups"],
        }
        canonical = optimizer_to_canonical(local, names, shards)
        sliced = full_optimizer_to_canonical(full, names, shards, "ck")
        assert canonical["state"].keys() == sliced["state"].keys()
        back = optimizer_from_canonical(canonical, names, shards, "ck")
        for i, entry in local["state"].items():
            assert all(torch.equal(back["state"][i][k], v) for k, v in entry.items())
        merged["state"].update(canonical["state"])
        merged["param_groups"] = canonical["param_groups"]
    assert "step" in merged["state"]["moe.experts.down_proj"]  # shared by the experts: stored once
    assert "exp_avg" in merged["state"]["moe.experts.down_proj[3]"]
    recombined = canonical_optimizer_to_full(merged)
    assert recombined["param_groups"] == full["param_groups"]
    for i, entry in full["state"].items():
        assert all(torch.equal(recombined["state"][i][k], v) for k, v in entry.items())


def test_optimizer_errors_name_the_values_the_rule_and_the_fix():
    model, opt = _trained(ep_wrap=False)
    names = param_names(opt, model)
    with pytest.raises(ValueError, match=r"holds a parameter of shape \(3,\) that is not a parameter of the"):
        param_names(torch.optim.SGD([nn.Parameter(torch.ones(3))], lr=1.0), model)
    with pytest.raises(ValueError, match=r"saved for other parameters: 1 of the optimizer's are not in it"):
        check_groups([{"params": names[:-1]}], names, "ck")
    with pytest.raises(ValueError, match=r"has 1 parameters but the optimizer has \d+; state is matched"):
        full_optimizer_to_canonical({"state": {}, "param_groups": [{"params": [0]}]}, names, {}, "ck")
    state = {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.ones(3, 2)}}, "param_groups": [{"params": [0]}]}
    with pytest.raises(NotImplementedError, match=r"`exp_avg` of expert parameter `w` is \(3, 2\), which does not"):
        optimizer_to_canonical(state, ["w"], {"w": ExpertShard(4, 0, 2)})
    canonical = {"state": {"w[0]": {"exp_avg": torch.ones(2)}}, "param_groups": [{"params": ["w"]}]}
    with pytest.raises(ValueError, match=r"lacks some experts of `w` \(this rank holds experts 0\.\.1\)"):
        optimizer_from_canonical(canonical, ["w"], {"w": ExpertShard(4, 0, 2)}, "ck")
    with pytest.raises(ValueError, match=r"`w` has experts \[0, 2\], not every expert 0\.\.E-1"):
        canonical_optimizer_to_full(
            {"state": {"w[0]": {"m": torch.ones(1)}, "w[2]": {"m": torch.ones(1)}}, "param_groups": [{"params": ["w"]}]}
        )


# -- both formats end to end, one process ----------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["sharded", "consolidated"])
def test_save_then_load_restores_model_and_optimizer_bitwise(tmp_path, fmt):
    model, opt = _trained(seed=0)
    path = tmp_path / "ck"
    checkpointer.save(_lightning_checkpoint(model, opt), path, fmt, LoadTarget.of(model, [opt]), None)
    assert path.is_dir() == (fmt == "sharded") and not list(tmp_path.glob("*.partial-*"))
    fresh, fresh_opt = _trained(seed=1)
    loaded = checkpointer.load(path, LoadTarget.of(fresh, [fresh_opt]), restore_rng_state=True)
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
    assert wrapped["param_groups"] == state["param_groups"] and wrapped["state"].keys() == state["state"].keys()
    for key, entry in state["state"].items():
        assert entry.keys() == wrapped["state"][key].keys()
        assert all(torch.equal(wrapped["state"][key][name], value) for name, value in entry.items())
    fresh, fresh_opt = _trained(seed=1)
    checkpointer.load_optimizer_states([LightningOptimizer(fresh_opt)], fresh, {"optimizer_states": [state]})
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert all(torch.equal(v, fresh_opt.state[q][k]) for k, v in opt.state[p].items())


def test_sharded_checkpoint_consolidates_offline_into_the_unsharded_model(tmp_path):
    model, opt = _trained(seed=0)
    checkpointer.save(_lightning_checkpoint(model, opt), tmp_path / "ck", "sharded", LoadTarget.of(model, [opt]), None)
    out = torch.load(consolidate_checkpoint(tmp_path / "ck", tmp_path / "full.ckpt"), weights_only=False)
    plain = Tiny(seed=1)  # no expert parallelism at all
    plain.load_state_dict(out["state_dict"], strict=True)
    x = torch.randn(1, 5, 8)
    torch.testing.assert_close(plain(x), model(x))
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    plain_opt.load_state_dict(out["optimizer_states"][0])  # the plain optimizer format


def test_loading_a_checkpoint_with_another_expert_count_is_refused(tmp_path):
    model, opt = _trained()
    checkpointer.save(_lightning_checkpoint(model, opt), tmp_path / "ck", "sharded", LoadTarget.of(model, [opt]), None)
    other = Tiny(num_experts=2)
    apply_expert_parallel(other, None)
    with pytest.raises(ValueError, match=r"holds 4 experts for `moe.experts.gate_up_proj` but the model has 2"):
        checkpointer.load(tmp_path / "ck", LoadTarget.of(other), restore_rng_state=False)


# -- atomicity -------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not hasattr(os, "fork"), reason="Requires: os.fork to kill a save midway")
def test_save_killed_before_commit_leaves_a_checkpoint_that_is_refused(tmp_path):
    model, opt = _trained()
    checkpoint, target = _lightning_checkpoint(model, opt), LoadTarget.of(model, [opt])
    pid = os.fork()
    if pid == 0:  # the child is killed (no cleanup runs) after writing every tensor, before the commit
        try:
            atomic.write_marker = lambda *args: os._exit(17)
            checkpointer.save(checkpoint, tmp_path / "ck", "sharded", target, None)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 17
    assert not (tmp_path / "ck").exists()  # the final name never appears
    (partial,) = tmp_path.glob("ck.partial-*")
    assert (partial / ".metadata").is_file()  # the data is all there, but not committed
    with pytest.raises(RuntimeError, match=r"is incomplete: it has no `COMMIT` marker, so the save that wrote it did"):
        checkpointer.load(partial, target, restore_rng_state=False)
    partial.rename(tmp_path / "renamed")  # a copied or renamed directory is refused the same way
    with pytest.raises(RuntimeError, match=r"no `COMMIT` marker.*Resume from an earlier checkpoint"):
        checkpointer.load(tmp_path / "renamed", target, restore_rng_state=False)


def test_replacing_a_checkpoint_keeps_a_complete_one_and_cleans_up(tmp_path):
    model, opt = _trained()
    target = LoadTarget.of(model, [opt])
    for _ in range(2):  # `last.ckpt` style: the same name saved twice
        checkpointer.save(_lightning_checkpoint(model, opt), tmp_path / "last.ckpt", "sharded", target, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    checkpointer.remove(tmp_path / "last.ckpt", rank=0)
    assert not list(tmp_path.iterdir())


def test_consolidated_staging_or_truncated_files_are_refused(tmp_path):
    model, opt = _trained()
    target = LoadTarget.of(model, [opt])
    checkpointer.save(_lightning_checkpoint(model, opt), tmp_path / "full.ckpt", "consolidated", target, None)
    data = (tmp_path / "full.ckpt").read_bytes()
    (tmp_path / "full.ckpt.partial-ab").write_bytes(data)
    with pytest.raises(RuntimeError, match=r"is the staging file of a save that was not committed"):
        checkpointer.load(tmp_path / "full.ckpt.partial-ab", target, restore_rng_state=False)
    (tmp_path / "cut.ckpt").write_bytes(data[: len(data) // 2])
    with pytest.raises(RuntimeError, match=r"cannot be read .*; it is truncated or not a torch checkpoint"):
        read_file(tmp_path / "cut.ckpt")


def test_path_and_format_errors(tmp_path):
    model, opt = _trained()
    target = LoadTarget.of(model, [opt])
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at .*missing\. Check the path"):
        checkpointer.load(tmp_path / "missing", target, restore_rng_state=False)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at .*gone\. Check the path"):
        atomic.read_marker(tmp_path / "gone")
    with pytest.raises(NotImplementedError, match=r"'s3://b/ck' is a URL; expert-parallel checkpoints are written"):
        checkpointer.load("s3://b/ck", target, restore_rng_state=False)
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
    target = LoadTarget.of(model, [opt])
    checkpointer.save(_lightning_checkpoint(model, opt), tmp_path / "ck", "sharded", target, None)
    expected = torch.rand(3)
    checkpointer.load(tmp_path / "ck", target, restore_rng_state=True)
    assert torch.equal(torch.rand(3), expected)
