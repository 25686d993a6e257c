"""Cutting models into pipeline chunks: the chained chunks are the unsplit model (forward, loss and gradients,
bitwise), names map onto the unsplit model's, each rank materialises only its own chunks, and every error."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.config.pipeline_layout import build_layout
from lightning_moe_overlap.pipeline.split import PipelineChunks, SplitModel, seeded_init, split_model

LAYOUTS = [(2, 1, None), (2, 2, None), (2, 1, "Ettt|tL"), (2, 2, "Et|ttt||L")]  # pp * vpp in {2, 4}; empty chunks


def _gpt() -> nn.Module:
    return MoEGPT(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_experts=4, ffn_hidden_size=32,
                  shared_expert_ffn_hidden_size=16)


def _hf(**overrides) -> nn.Module:
    pytest.importorskip("transformers", reason="Requires: transformers>=5")
    from lightning_moe_overlap.demo_hf import HFMoECausalLM

    return HFMoECausalLM("qwen3_moe", config_overrides={"num_hidden_layers": 4, **overrides})


BUILD = {"moegpt": _gpt, "qwen3_moe": _hf}


def _unsplit_loss(kind: str, model: nn.Module, tokens):
    return model._loss(tokens) if kind == "moegpt" else model.model(input_ids=tokens, labels=tokens).loss


def _meta_split(kind: str, layout) -> SplitModel:
    with torch.device("meta"):
        model = BUILD[kind]()
    return split_model(model, layout)


def _chain(split: SplitModel, tokens):
    args, target = split.prepare_batch(tokens)
    x = args[0]
    for chunk in split.chunks:
        x = chunk(x)
    return split.loss_fn(x, target)


@pytest.mark.parametrize("kind", list(BUILD))
@pytest.mark.parametrize("pp,vpp,text", LAYOUTS)
def test_chained_chunks_equal_unsplit_model(kind, pp, vpp, text):
    torch.manual_seed(0)
    ref = BUILD[kind]()
    split = _meta_split(kind, build_layout(4, pp, vpp, text))
    for rank in range(pp):  # as the ranks would, each its own chunks
        split.materialize(split.chunk_indices_of_rank(rank), "cpu", state_dict=ref.state_dict())
    tokens = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(1))

    loss, ref_loss = _chain(split, tokens), _unsplit_loss(kind, ref, tokens)
    assert torch.equal(loss, ref_loss)
    loss.backward()
    ref_loss.backward()
    ref_params = dict(ref.named_parameters())
    checked = 0
    for c, chunk in enumerate(split.chunks):
        for name, p in chunk.named_parameters():
            ref_p = ref_params[split.fqn(c, name)]
            assert ref_p.grad is not None and torch.equal(p.grad, ref_p.grad), (c, name)
            checked += 1
    assert checked == len(ref_params)


@pytest.mark.parametrize("kind", list(BUILD))
def test_name_map_round_trips(kind):
    torch.manual_seed(0)
    ref = BUILD[kind]()
    split = _meta_split(kind, build_layout(4, 2, 2))
    split.materialize(range(4), "cpu", state_dict=ref.state_dict())
    state = split.unsplit_state_dict(range(4))
    assert state.keys() == ref.state_dict().keys()
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in state.items())
    names = [fqn for c in range(4) for fqn in split.name_map(c).values()]
    assert len(names) == len(set(names))  # one owner per key
    layer = "layers.2.mlp.experts.down_proj" if kind == "moegpt" else "model.layers.2.mlp.experts.down_proj"
    unsplit = "layers.2.mlp.experts.down_proj" if kind == "moegpt" else "model.model.layers.2.mlp.experts.down_proj"
    assert split.name_map(2)[layer] == unsplit  # global layer index kept; the LightningModule's prefix added
    other = copy.deepcopy(ref)
    other.load_state_dict(state)  # a pp-split checkpoint loads into the unsplit model


@pytest.mark.parametrize("kind", list(BUILD))
def test_seeded_init_equals_unsplit_and_each_rank_allocates_its_own(kind):
    torch.manual_seed(0)
    ref = BUILD[kind]()
    before = copy.deepcopy(ref.state_dict())
    split = _meta_split(kind, build_layout(4, 2, 2))
    seeded_init(ref, 7, split.init_module)
    assert any(not torch.equal(before[k], v) for k, v in ref.state_dict().items())  # the init did something

    split.materialize([3, 1], "cpu", seed=7)  # rank 1 only, in any order
    real = {n for c in (1, 3) for n in split.name_map(c).values()}
    for c, chunk in enumerate(split.chunks):
        assert all(p.is_meta == (c in (0, 2)) for p in chunk.parameters())  # rank 0's chunks allocate nothing
    state = split.unsplit_state_dict([1, 3])
    assert state.keys() == real
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in state.items())

    held = sum(p.numel() for p in split.model.parameters() if not p.is_meta)
    assert held == sum(split.parameter_counts()[c] for c in (1, 3))
    layers = split.model.layers if kind == "moegpt" else split.model.model.model.layers
    layer_total = sum(p.numel() for p in layers.parameters())
    layer_held = sum(p.numel() for p in layers.parameters() if not p.is_meta)
    assert layer_held * 2 == layer_total  # 1/pp of the layer parameters

    other = _meta_split(kind, build_layout(4, 2, 2))
    other.materialize([1, 3], "cpu", seed=8)
    reseeded = other.unsplit_state_dict([1, 3])
    assert any(not torch.equal(reseeded[k], v) for k, v in state.items())  # the seed matters


def test_hf_rotary_buffers_are_recomputed_on_materialize():
    torch.manual_seed(0)
    ref = _hf()
    split = _meta_split("qwen3_moe", build_layout(4, 2, 1))
    split.materialize([1], "cpu", state_dict=ref.state_dict())  # not in the state dict: non-persistent
    assert torch.equal(split.chunks[1].model.rotary_emb.inv_freq, ref.model.model.rotary_emb.inv_freq)


# -- the hook for other models -----------------------------------------------------------------------------------
class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class _Chunk(nn.Module):
    def __init__(self, blocks) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*blocks)

    def forward(self, x):
        return self.blocks(x)


class _SelfSplitting(nn.Module):
    """Any model: implements ``configure_pipeline`` itself."""

    def __init__(self) -> None:
        super().__init__()
        self.stack = nn.ModuleList(_Block() for _ in range(4))

    def forward(self, x):
        for block in self.stack:
            x = block(x)
        return x

    def configure_pipeline(self, layout):
        modules = [_Chunk([self.stack[i] for i in c.layers]) for c in layout.chunks]
        return PipelineChunks(modules, nn.functional.mse_loss, lambda batch: ((batch[0],), batch[1]))


def test_hook_for_other_models():
    torch.manual_seed(0)
    ref = _SelfSplitting()
    with torch.device("meta"):
        model = _SelfSplitting()
    split = split_model(model, build_layout(4, 2, 2))
    assert split.name_map(2) == {"blocks.0.fc.weight": "stack.2.fc.weight", "blocks.0.fc.bias": "stack.2.fc.bias"}
    split.materialize(range(4), "cpu", state_dict=ref.state_dict())
    batch = (torch.randn(2, 4), torch.randn(2, 4))
    assert torch.equal(_chain(split, batch), nn.functional.mse_loss(ref(batch[0]), batch[1]))
    split.materialize(range(4), "cpu", seed=3)  # default init: reset_parameters()
    seeded_init(ref, 3, None)
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in split.unsplit_state_dict(range(4)).items())


def test_splitter_function_wins_over_the_hook():
    model = _SelfSplitting()
    seen = []

    def splitter(m, layout):
        seen.append(layout.num_chunks)
        return m.configure_pipeline(layout)

    split_model(model, build_layout(4, 2), splitter=splitter)
    assert seen == [2]


# -- errors ------------------------------------------------------------------------------------------------------
def _with(modules=None, result=None):
    def splitter(m, layout):
        if result is not None:
            return result
        return PipelineChunks(modules(m, layout), nn.functional.mse_loss, lambda b: ((b,), b))

    return splitter


def test_error_splitter_returns_wrong_type():
    with pytest.raises(TypeError, match=r"returned list\. Rule: a splitter returns PipelineChunks"):
        split_model(_SelfSplitting(), build_layout(4, 2), splitter=_with(result=[nn.Linear(1, 1)]))


def test_error_wrong_number_of_chunks():
    one = _with(lambda m, lay: [_Chunk(list(m.stack))])
    with pytest.raises(ValueError, match=r"returned 1 chunk modules for a layout of pp \* vpp = 2 \* 1 = 2 chunks"):
        split_model(_SelfSplitting(), build_layout(4, 2), splitter=one)


def test_error_chunk_creates_its_own_parameters():
    fresh = _with(lambda m, lay: [_Chunk(list(m.stack[:2])), _Chunk([_Block(), *m.stack[2:]])])
    with pytest.raises(KeyError, match=r"chunk 1's 'blocks.0.fc.weight' is not part of the unsplit model"):
        split_model(_SelfSplitting(), build_layout(4, 2), splitter=fresh)


def test_error_parameter_in_no_chunk():
    partial = _with(lambda m, lay: [_Chunk(list(m.stack[:2])), _Chunk([m.stack[2]])])
    with pytest.raises(ValueError, match=r"2 parameter\(s\) of the unsplit model are in no chunk"):
        split_model(_SelfSplitting(), build_layout(4, 2), splitter=partial)


def test_error_key_missing_from_model_state_dict():
    class Hidden(_SelfSplitting):
        def state_dict(self, *args, **kwargs):
            state = super().state_dict(*args, **kwargs)
            state.pop("stack.3.fc.bias")
            return state

    with pytest.raises(KeyError, match=r"chunk 1's 'blocks.1.fc.bias' maps to 'stack.3.fc.bias', which is not a key"):
        split_model(Hidden(), build_layout(4, 2))


def test_error_tied_weights():
    with pytest.raises(NotImplementedError, match=r"'model.model.embed_tokens.weight' is in chunk 0 and chunk 1 "
                                                  r"\(tied weights.*tie_word_embeddings=False"):
        split_model(_hf(tie_word_embeddings=True), build_layout(4, 2))


def test_error_hf_router_aux_loss():
    with pytest.raises(NotImplementedError, match=r"output_router_logits=True.*Fix: set config.output_router_logits"):
        split_model(_hf(output_router_logits=True), build_layout(4, 2))


def test_error_layout_does_not_fit_model():
    with pytest.raises(ValueError, match=r"the layout holds 6 layers but MoEGPT has 4.*build_layout\(num_layers=4"):
        split_model(_gpt(), build_layout(6, 2))
    with pytest.raises(ValueError, match=r"the layout has MTP layers \('m'\) but MoEGPT has none"):
        split_model(_gpt(), build_layout(4, 2, 2, "Ett|tt|m|L", num_mtp_layers=1))


def test_error_unknown_model():
    with pytest.raises(TypeError, match=r"no built-in splitter knows Sequential.*configure_pipeline\(layout\)"):
        split_model(nn.Sequential(nn.Linear(2, 2)), build_layout(1, 1))


def test_error_state_dict_lacks_keys():
    split = split_model(_SelfSplitting(), build_layout(4, 2))
    with pytest.raises(KeyError, match=r"the state dict lacks 4 key\(s\) of chunk 1, e.g. \['stack.2.fc.bias'"):
        split.materialize([1], "cpu", state_dict={})


def test_error_module_without_init():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * self.w

    class Model(_SelfSplitting):
        def __init__(self) -> None:
            super().__init__()
            self.stack[0] = Scale()

    split = split_model(Model(), build_layout(4, 2))
    with pytest.raises(TypeError, match=r"Scale has parameters and no reset_parameters\(\).*give PipelineChunks an"):
        split.materialize([0], "cpu")
