"""Checkpoints of one pipeline rank's view, in one process: held tensors only, other ranks' keys absent, not missing.

A *view* is the unsplit 4-layer ``MoEGPT`` as pp rank ``r`` of pp=2 holds it (docs/pipeline.md): the other rank's
chunk on meta, the held chunk expert-parallel (ep=1). The layouts across processes are in
tests/distributed/test_checkpoint_pipeline.py.
"""

from __future__ import annotations

import pytest
import torch

from lightning_moe_overlap.checkpoint import checkpointer
from lightning_moe_overlap.checkpoint.consolidated import gather_full
from lightning_moe_overlap.checkpoint.optimizer import merge_param_groups
from lightning_moe_overlap.checkpoint.state import absent_keys, optimizer_state
from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.moe.ep import apply_expert_parallel
from lightning_moe_overlap.config.pipeline_layout import build_layout
from lightning_moe_overlap.pipeline.split import split_model

CONFIG = dict(vocab_size=16, hidden_size=8, num_layers=4, num_heads=2, num_experts=4, top_k=2, ffn_hidden_size=4)


def stepped(model: MoEGPT, params) -> torch.optim.AdamW:
    opt = torch.optim.AdamW(params, lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for p in model.parameters():
        if not p.is_meta:
            p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    return opt


def full_model() -> tuple[MoEGPT, torch.optim.AdamW]:
    model = MoEGPT(**CONFIG, seed=0)
    apply_expert_parallel(model, None)
    return model, stepped(model, model.parameters())


def view(pp_rank: int, *, held_only: bool = False) -> tuple[MoEGPT, torch.optim.AdamW]:
    """pp rank ``pp_rank`` of pp=2 (other values than :func:`full_model`; its optimizer has not stepped)."""
    model = MoEGPT(**CONFIG, seed=1)
    split = split_model(model, build_layout(4, pp=2))
    for c, chunk in enumerate(split.chunks):
        if c == pp_rank:
            apply_expert_parallel(chunk, None)
        else:
            chunk.to("meta")
    params = [p for p in model.parameters() if not (held_only and p.is_meta)]
    return model, torch.optim.AdamW(params, lr=1e-2)


def lightning_checkpoint(model, opt) -> dict:
    return {
        "state_dict": checkpointer.module_state(model),
        "optimizer_states": [checkpointer.optimizer_state(opt, model)],
    }


def test_a_view_saves_its_held_tensors_only_and_names_the_rest_absent():
    model, opt = view(1)
    state = checkpointer.module_state(model)
    assert state and not any(v.is_meta for v in state.values())
    assert "head.weight" in state and "embed.weight" not in state
    assert "layers.3.mlp.experts.down_proj" in state and "layers.0.mlp.experts.down_proj" not in state
    unsplit = list(MoEGPT(**CONFIG).state_dict())
    assert set(absent_keys(model)) == {k for k in unsplit if k.startswith(("embed.", "layers.0.", "layers.1."))}
    assert list(model.state_dict()) == unsplit
    # the state initialised for a load: still no entry of a meta parameter, not even its `step`
    flat = optimizer_state(model, opt, template=True)
    assert not any(k.startswith("state.embed.") for k in flat) and "state.head.weight.exp_avg" in flat


@pytest.mark.parametrize("fmt", ["sharded", "consolidated"])
@pytest.mark.parametrize("held_only", [False, True])
def test_a_view_loads_a_whole_model_checkpoint_strictly(tmp_path, fmt, held_only):
    model, opt = full_model()
    checkpointer.save(lightning_checkpoint(model, opt), tmp_path / "ck", fmt, model, [opt], None)
    source = {n: p for n, p in model.named_parameters()}
    for pp_rank in range(2):
        mine, mine_opt = view(pp_rank, held_only=held_only)
        loaded = checkpointer.load(tmp_path / "ck", mine, [mine_opt], strict=True)
        checkpointer.load_module_state(mine, loaded, strict=True)
        checkpointer.load_optimizer_states([mine_opt], mine, loaded)
        held = 0
        for name, p in mine.named_parameters():
            if p.is_meta:
                assert p not in mine_opt.state
                continue
            held += 1
            assert torch.equal(p, source[name]), name
            saved = opt.state[source[name]]
            assert all(torch.equal(mine_opt.state[p][k], v) for k, v in saved.items()), name
        assert held > 0


@pytest.mark.parametrize("fmt", ["sharded", "consolidated"])
def test_a_strict_load_still_refuses_keys_missing_from_the_checkpoint(tmp_path, fmt):
    model, opt = full_model()
    checkpoint = lightning_checkpoint(model, opt)
    del checkpoint["state_dict"]["head.weight"]  # held by pp rank 1
    checkpointer.save(checkpoint, tmp_path / "ck", fmt, model, [opt], None)
    if fmt == "consolidated":  # written from the module itself: take the key out of the file
        full = torch.load(tmp_path / "ck", weights_only=False)
        del full["state_dict"]["head.weight"]
        torch.save(full, tmp_path / "ck")
    holder, _ = view(1)
    with pytest.raises(ValueError, match=r"1 keys of the model are not in it \['head.weight'\]"):
        checkpointer.load(tmp_path / "ck", holder, [])
    other, _ = view(0)
    if fmt == "consolidated":  # every rank reads the whole file, so every rank refuses it alike
        with pytest.raises(ValueError, match=r"1 keys of the model are not in it \['head.weight'\]"):
            checkpointer.load(tmp_path / "ck", other, [])
    else:  # the holder's error reaches every rank (checks.agree)
        checkpointer.load(tmp_path / "ck", other, [])


def test_load_module_state_compares_held_tensors_only():
    model, _ = view(1)
    state = checkpointer.module_state(model)
    checkpointer.load_module_state(model, {"state_dict": state}, strict=True)
    del state["norm.weight"]
    checkpointer.load_module_state(model, {"state_dict": state}, strict=False)
    with pytest.raises(RuntimeError, match=r"does not fit the tensors this rank holds: 1 are not in it \['norm.weight"):
        checkpointer.load_module_state(model, {"state_dict": state}, strict=True)


def test_param_groups_merge_into_the_unsplit_optimizers():
    order = ["a", "b", "c", "d"]
    per_rank = [[{"lr": 1.0, "params": ["c", "a"]}], [{"lr": 1.0, "params": ["d", "b"]}]]
    assert merge_param_groups(per_rank, order) == [{"lr": 1.0, "params": ["a", "b", "c", "d"]}]
    complete = [[{"lr": 1.0, "params": ["d", "c", "b", "a"]}], [{"lr": 1.0, "params": ["b"]}]]
    assert merge_param_groups(complete, order)[0]["params"] == ["d", "c", "b", "a"]  # a whole optimizer's order
    with pytest.raises(ValueError, match=r"the ranks' optimizers have \[1, 2\] parameter groups; a checkpoint keyed"):
        merge_param_groups([[{"params": ["a"]}], [{"params": ["b"]}, {"params": []}]], order)


def test_gather_full_of_a_view_needs_the_groups():
    model, opt = view(0)
    with pytest.raises(ValueError, match=r"tensors of the model are on the meta device here .* Fix: pass `groups=`"):
        gather_full(lightning_checkpoint(model, opt), model, [opt], None, b"", world_size=1)
