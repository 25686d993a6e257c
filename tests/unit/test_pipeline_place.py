"""``PipelinedModel.place``: a rank's own chunks on its device, every tensor of the other chunks on meta."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_moe_overlap.config import OverlapConfig
from lightning_moe_overlap.demo import MoEGPT, gpt_init_module
from lightning_moe_overlap.pipeline.pipelined import PipelinedModel
from lightning_moe_overlap.pipeline.split import seeded_init

MODEL = dict(vocab_size=16, hidden_size=8, num_layers=4, num_heads=2, num_experts=4, ffn_hidden_size=8)
CONFIG = OverlapConfig(pp=2, vpp=2, num_microbatches=4, overlap=False)


def _cut(model: torch.nn.Module, pp_rank: int) -> PipelinedModel:
    groups = SimpleNamespace(coords=SimpleNamespace(pp=pp_rank), pp=None)  # place() needs no process group
    return PipelinedModel.cut(model, CONFIG, groups)


@pytest.mark.parametrize("pp_rank", [0, 1])
def test_own_chunks_keep_their_values_and_objects_the_others_go_to_meta(pp_rank):
    model = MoEGPT(**MODEL)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    own = _cut(model, pp_rank)
    held = {id(p) for chunk in own.held_chunks for p in chunk.parameters()}
    own.place(torch.device("cpu"), seed=0)
    names = {name for chunk in own.held_chunks for name, _ in chunk.named_parameters()}
    assert own.held == ([0, 2] if pp_rank == 0 else [1, 3]) and names
    for name, p in model.named_parameters():
        if id(p) in held:
            assert p.device.type == "cpu" and torch.equal(p, before[name]), name
        else:
            assert p.is_meta, name
    assert {id(p) for chunk in own.held_chunks for p in chunk.parameters()} == held  # the same objects


def test_a_model_built_on_meta_gets_its_chunks_seeded_like_the_unsplit_model():
    with torch.device("meta"):
        model = MoEGPT(**MODEL)
    own = _cut(model, 1)
    own.place(torch.device("cpu"), seed=7)
    reference = MoEGPT(**MODEL)
    seeded_init(reference, 7, gpt_init_module)
    expected = dict(reference.named_parameters())
    got = {n: p for n, p in model.named_parameters() if not p.is_meta}
    assert got and all(n.startswith(("layers.1.", "layers.3.", "norm.", "head.")) for n in got)
    for name, p in got.items():
        assert torch.equal(p, expected[name]), name


def test_a_meta_tensor_outside_every_chunk_is_refused():
    with torch.device("meta"):
        model = MoEGPT(**MODEL)
        model.register_buffer("step_scale", torch.ones(1))  # not part of any chunk
    with pytest.raises(RuntimeError, match=r"MoEGPT\.step_scale is on the meta device and belongs to no pipeline "
                       r"chunk.*Fix: build it outside the meta device"):
        _cut(model, 0).place(torch.device("cpu"), seed=0)
