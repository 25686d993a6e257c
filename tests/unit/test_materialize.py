"""A model built on the meta device, materialised as the strategy does it (``parallelize/materialize.py``), one process.

Oracle: the same model built with real tensors and ``seeded_init(model, seed, its init hook)`` applied, its state
(persistent and non-persistent buffers too). Also: one experts layer at a time is full while the experts are
initialised; with weights to load the experts are allocated and not initialised; ties stay ties; the init hook's
resolution order; what a rank holds by unsplit name (``parallelize/held_tensors.py``) at pp = 1 and pp = 2.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn

from lightning_moe_overlap.config import OverlapConfig
from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.moe.ep import apply_expert_parallel
from lightning_moe_overlap.moe.ep import ExpertParallelExperts
from lightning_moe_overlap.moe.experts import Experts
from lightning_moe_overlap.parallelize.held_tensors import global_shapes, held_tensors
from lightning_moe_overlap.parallelize.materialize import (
    MetaInit,
    find_meta_experts,
    init_module_of,
    materialize_dense,
    materialize_experts,
    meta_init_of,
)
from lightning_moe_overlap.pipeline.pipelined import PipelinedModel
from lightning_moe_overlap.pipeline.split import reset_module, seeded_init, split_model
from lightning_moe_overlap.config.pipeline_layout import build_layout

SEED = 5
GPT = dict(vocab_size=16, hidden_size=8, num_layers=4, num_heads=2, num_experts=4, ffn_hidden_size=8,
           shared_expert_ffn_hidden_size=8)  # fmt: skip


def _gpt() -> MoEGPT:
    return MoEGPT(**GPT)


def _hf(**overrides) -> LightningModule:
    pytest.importorskip("transformers", reason="Requires: transformers>=5")
    from lightning_moe_overlap.demo_hf import HFMoECausalLM

    return HFMoECausalLM("qwen3_moe", config_overrides={"num_hidden_layers": 3, **overrides})


BUILD = {"moegpt": _gpt, "qwen3_moe": _hf, "qwen3_moe_tied": lambda: _hf(tie_word_embeddings=True)}


def _oracle(build) -> dict[str, torch.Tensor]:
    model = build()
    seeded_init(model, SEED, model.init_module)
    return {**model.state_dict(), **dict(model.named_buffers())}


def _materialize(model: nn.Module, init: MetaInit) -> None:
    """The strategy's steps at pp = 1, ep = 1: dense, then the experts (made expert-parallel) one layer at a time."""
    materialize_dense(model, init)
    pending = find_meta_experts(model)
    apply_expert_parallel(model, None)
    materialize_experts(pending, init)


@pytest.mark.parametrize("kind", list(BUILD))
def test_a_meta_built_model_gets_the_values_of_seeded_init(kind):
    expected = _oracle(BUILD[kind])
    with torch.device("meta"):
        model = BUILD[kind]()
    _materialize(model, meta_init_of(model, torch.device("cpu"), SEED))
    got = {**model.state_dict(), **dict(model.named_buffers())}
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert not got[key].is_meta and torch.equal(got[key], value), key
    assert any(isinstance(m, ExpertParallelExperts) for m in model.modules())


def test_tied_weights_stay_tied():
    with torch.device("meta"):
        model = _hf(tie_word_embeddings=True)
    hf = model.model
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    materialize_dense(model, meta_init_of(model, torch.device("cpu"), SEED))
    assert hf.lm_head.weight is hf.model.embed_tokens.weight and not hf.lm_head.weight.is_meta


class _Spy(MoEGPT):
    """Records, at each init of an experts module, how many experts modules hold memory (built on meta)."""

    def __init__(self) -> None:
        with torch.device("meta"):
            super().__init__(**GPT)
        self.all_experts = [m for m in self.modules() if isinstance(m, Experts)]  # plain list: not registered
        self.full_at_init: list[int] = []
        self.initialised: list[type] = []

    def init_module(self, module: nn.Module) -> None:
        self.initialised.append(type(module))
        if isinstance(module, Experts):
            self.full_at_init.append(sum(not m.gate_up_proj.is_meta for m in self.all_experts))
        super().init_module(module)


def test_one_experts_layer_at_a_time_is_full_and_freed_after():
    model = _Spy()
    _materialize(model, meta_init_of(model, torch.device("cpu"), SEED))
    assert model.full_at_init == [1] * GPT["num_layers"]
    assert all(m.gate_up_proj.is_meta and m.down_proj.is_meta for m in model.all_experts)  # the sources freed


def test_with_weights_to_load_the_experts_are_allocated_and_not_initialised():
    expected = _oracle(_gpt)
    model = _Spy()
    model.hf_weights = "a folder"  # what a module declares for the loader
    init = meta_init_of(model, torch.device("cpu"), SEED)
    assert init.experts_empty
    _materialize(model, init)
    assert Experts not in model.initialised and model.full_at_init == []
    for name, value in model.state_dict().items():
        assert not value.is_meta, name
        if ".experts." in name:
            assert value.shape == expected[name].shape, name
        else:
            assert torch.equal(value, expected[name]), name  # the rest keeps its seeded init (buffers need it)


def test_a_model_built_with_values_is_left_as_it_is():
    model = _gpt()
    before = {n: (p, p.detach().clone()) for n, p in model.state_dict(keep_vars=True).items()}
    init = meta_init_of(model, torch.device("cpu"), SEED)
    assert materialize_dense(model, init) == [] and find_meta_experts(model) == []
    for name, value in model.state_dict(keep_vars=True).items():
        assert value is before[name][0] and torch.equal(value, before[name][1]), name


def test_init_hook_resolution_order():
    gpt = _gpt()
    assert init_module_of(gpt) == gpt.init_module  # 1. the LightningModule's hook

    class NoHook(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

    split = split_model(gpt, build_layout(4, 2, 1))
    assert init_module_of(NoHook(), split) is split.init_module  # 2. the splitter's at pp > 1
    hf = _hf()
    plain = nn.Module()
    plain.model = hf.model  # an HF decoder LM as a module's `model`, no hook
    assert init_module_of(plain) == hf.model._init_weights  # 3. HF's own
    assert init_module_of(NoHook()) is reset_module  # 4. reset_parameters()


def test_error_a_meta_built_module_without_init_names_the_hook():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(3))

    with torch.device("meta"):
        model = nn.Sequential(Scale())
    with pytest.raises(TypeError, match=r"Scale has parameters and no reset_parameters\(\).*define "
                                        r"`init_module\(self, module\)` on the LightningModule"):  # fmt: skip
        materialize_dense(model, meta_init_of(model, torch.device("cpu"), SEED))


# -- what a rank holds, by unsplit name ---------------------------------------------------------------------------
def test_held_tensors_and_global_shapes_at_pp1():
    expected = _oracle(_gpt)
    with torch.device("meta"):
        model = _gpt()
    shapes_before = global_shapes(model)
    _materialize(model, meta_init_of(model, torch.device("cpu"), SEED))
    held = held_tensors(model)
    assert held.keys() == model.state_dict().keys() == shapes_before.keys()
    params = dict(model.named_parameters())
    for name, tensor in held.items():
        assert torch.equal(tensor, expected[name]), name
        assert name not in params or tensor is params[name], name  # the objects a loader writes into
    assert global_shapes(model) == shapes_before == {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_held_tensors_and_global_shapes_at_pp2():
    expected = _oracle(_gpt)
    with torch.device("meta"):
        model = _gpt()
    groups = SimpleNamespace(coords=SimpleNamespace(pp=1), pp=None)  # place() needs no process group
    pipeline = PipelinedModel.cut(model, OverlapConfig(pp=2, vpp=2, num_microbatches=4, overlap=False), groups)
    pipeline.place(torch.device("cpu"), seed=SEED, materialize=False)
    assert all(p.is_meta for p in model.parameters())  # nothing allocated yet
    init = meta_init_of(model, torch.device("cpu"), SEED, pipeline.split)
    materialize_dense(model, init, pipeline.held_chunks)
    pending = find_meta_experts(model, pipeline.held_chunks)
    assert [p.name for p in pending] == ["layers.1.mlp.experts", "layers.3.mlp.experts"]
    for chunk in pipeline.held_chunks:
        apply_expert_parallel(chunk, None)
    materialize_experts(pending, init)
    held = held_tensors(model, pipeline)
    unsplit = {fqn for c in pipeline.held for fqn in pipeline.split.name_map(c).values()}
    assert held.keys() == unsplit and all(k.startswith(("layers.1.", "layers.3.", "norm.", "head.")) for k in held)
    for name, tensor in held.items():
        assert torch.equal(tensor, expected[name]), name
    assert global_shapes(model) == {k: tuple(v.shape) for k, v in expected.items() if k in model.state_dict()}
    assert set(global_shapes(model)) == set(model.state_dict())  # the whole model, held or not

