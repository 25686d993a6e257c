"""``SelectiveRecompute`` in one process: validation, the name map, and bitwise-equal training with less memory.

The distributed twin (ep=2, the overlap on and off, every dispatcher, the Trainer) is
tests/distributed/test_memory.py.
"""

from __future__ import annotations

import jsonargparse
import pytest
import torch
from lightning.pytorch import Callback
from torch import nn

from lightning_moe_overlap.callbacks import (
    ExpertStage,
    Output,
    SavedActivationMeter,
    SelectiveRecompute,
    _checkpoint,
    _patch,
    find_layers,
    register_layer_names,
    unregister_layer_names,
)
from lightning_moe_overlap.demo import MoEDecoderLayer, MoEGPT
from lightning_moe_overlap.moe.ep import apply_expert_parallel
from lightning_moe_overlap.moe.layer import MoELayer
from lightning_moe_overlap.overlap.engine import OverlapEngine
from lightning_moe_overlap.overlap.runtime import CommRuntime

VOCAB = 64


def gpt(ep: bool = True, shared: int | None = 16, layers: int = 3) -> MoEGPT:
    model = MoEGPT(
        vocab_size=VOCAB, hidden_size=32, num_layers=layers, num_heads=4, num_experts=4, ffn_hidden_size=32,
        shared_expert_ffn_hidden_size=shared,
    )
    if ep:
        apply_expert_parallel(model, None, runtime=CommRuntime())
    return model


def train(model: nn.Module, callbacks=(), steps: int = 2, loss_fn=None) -> tuple[list[torch.Tensor], int]:
    """SGD steps; returns the parameters and the activation bytes held after the last forward."""
    loss_fn = loss_fn or (lambda m, tokens: m._loss(tokens))
    for cb in callbacks:
        cb.apply(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    held = 0
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (2, 9), generator=g)
        opt.zero_grad()
        with SavedActivationMeter(model) as meter:
            loss = loss_fn(model, tokens)
        held = meter.held_bytes()
        loss.backward()
        opt.step()
    for cb in callbacks:
        cb.remove()
    return [p.detach().clone() for p in model.parameters()], held


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: intra-op worker threads only spin, next to the engine's two lanes or other processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference() -> tuple[list[torch.Tensor], int]:
    return train(gpt())


# -- validation --------------------------------------------------------------------------------------------------
def test_constructor_rejects_bad_values():
    with pytest.raises(ValueError, match=r"granularity='partial' is not 'selective' or 'full'"):
        SelectiveRecompute(modules=["mlp"], granularity="partial")
    with pytest.raises(ValueError, match=r"modules=\['mlp'\] with granularity='full'.*Drop `modules`"):
        SelectiveRecompute(modules=["mlp"], granularity="full")
    with pytest.raises(ValueError, match=r"method='block', num_layers=None with granularity='selective'"):
        SelectiveRecompute(modules=["mlp"], method="block")
    with pytest.raises(ValueError, match=r"num_layers=2 with granularity='selective'"):
        SelectiveRecompute(modules=["mlp"], num_layers=2)
    with pytest.raises(ValueError, match=r"unknown name\(s\) \['attention'\]; the valid names are \['core_attn'"):
        SelectiveRecompute(modules=["attention"])
    with pytest.raises(TypeError, match=r"modules='mlp' must be a list of names"):
        SelectiveRecompute(modules="mlp")
    with pytest.raises(ValueError, match=r"modules is empty"):
        SelectiveRecompute(modules=[])
    with pytest.raises(ValueError, match=r"num_layers=0 must be a positive integer"):
        SelectiveRecompute(granularity="full", num_layers=0)
    with pytest.raises(ValueError, match=r"method='blocks' is not 'uniform' or 'block'"):
        SelectiveRecompute(granularity="full", method="blocks")


def test_apply_rejects_what_the_model_does_not_have():
    with pytest.raises(ValueError, match=r"modules \['shared_experts'\] are not in this model.*present here are"):
        SelectiveRecompute(modules=["shared_experts"]).apply(gpt(shared=None))
    with pytest.raises(ValueError, match=r"\['moe_act', 'a2a_overlap_mlp'\] act on the expert-parallel experts"):
        SelectiveRecompute(modules=["moe_act", "a2a_overlap_mlp"]).apply(gpt(ep=False))
    with pytest.raises(ValueError, match=r"mla_up_proj"):
        SelectiveRecompute(modules=["mla_up_proj"]).apply(gpt())
    with pytest.raises(ValueError, match=r"no decoder layer recognised in Sequential.*register_layer_names"):
        SelectiveRecompute(modules=["mlp"]).apply(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match=r"method='block' with num_layers=5, but the model has 3 decoder layers"):
        SelectiveRecompute(granularity="full", method="block", num_layers=5).apply(gpt())


def test_tensor_names_are_not_recompute_modules():
    spec = register_layer_names(MoEDecoderLayer, {"norm_out": Output("mlp_norm")}, name="test_tensor_name")
    try:
        with pytest.raises(ValueError, match=r"\['norm_out'\] name tensors, not modules"):
            SelectiveRecompute(modules=["norm_out"]).apply(gpt())
    finally:
        unregister_layer_names(spec)


def test_names_that_cannot_be_recomputed():
    spec = register_layer_names(
        MoEDecoderLayer, {"fc1": ExpertStage("mlp.experts", "fc1")}, name="test_fc1_stage"
    )
    try:
        with pytest.raises(ValueError, match=r"is not something that can be recomputed.*Map the name onto a module"):
            SelectiveRecompute(modules=["fc1"]).apply(gpt())
    finally:
        unregister_layer_names(spec)


def test_register_layer_names_checks_its_arguments():
    with pytest.raises(TypeError, match=r"layer_type=3 must be an `nn.Module` subclass or a predicate"):
        register_layer_names(3, {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"the target of 'x' is 5"):
        register_layer_names(nn.Linear, {"x": 5})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"a spec named 'transformers_v5' is already registered"):
        register_layer_names(nn.Linear, {"x": "y"}, name="transformers_v5")
    with pytest.raises(ValueError, match=r"no user spec named 'nothing'"):
        unregister_layer_names("nothing")


# -- bitwise and memory ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "names",
    [["core_attn"], ["mlp"], ["moe"], ["moe_act"], ["shared_experts"], ["routed_experts"], ["layernorm"],
     ["a2a_overlap_attn", "a2a_overlap_post_attn", "a2a_overlap_mlp"], ["layernorm", "a2a_overlap_attn", "moe"]],
)
def test_selective_is_bitwise_equal_and_holds_less(reference, names):
    params, held = train(gpt(), [SelectiveRecompute(modules=names)])
    assert equal(params, reference[0])
    assert held < reference[1]


@pytest.mark.parametrize("method,num_layers", [("uniform", None), ("uniform", 2), ("uniform", 3), ("block", 2)])
def test_full_is_bitwise_equal_and_holds_less(reference, method, num_layers):
    params, held = train(gpt(), [SelectiveRecompute(granularity="full", method=method, num_layers=num_layers)])
    assert equal(params, reference[0])
    assert held < reference[1]


def test_larger_uniform_units_keep_fewer_inputs():
    _, one = train(gpt(layers=4), [SelectiveRecompute(granularity="full", num_layers=1)])
    _, two = train(gpt(layers=4), [SelectiveRecompute(granularity="full", num_layers=2)])
    _, four = train(gpt(layers=4), [SelectiveRecompute(granularity="full", num_layers=4)])
    hidden = 2 * 8 * 32 * 4  # one [B, S, D] float32 layer input
    assert one - two == 2 * hidden and two - four == hidden  # inputs kept: 4, 2 (x0, x2), 1 (x0)


def test_remove_restores_the_model():
    model = gpt()
    cb = SelectiveRecompute(modules=["a2a_overlap_attn", "a2a_overlap_mlp", "moe_act", "core_attn"])
    layer = model.layers[0]
    experts, layout = layer.mlp.experts, layer.mlp.experts.layout
    cb.apply(model)
    assert "forward" in vars(layer.attn)
    assert experts.stage("local").wrapped and experts.stage("act").wrapped and not experts.stage("fc1").wrapped
    cb.remove()
    assert "forward" not in vars(layer.attn) and not experts.stage("local").wrapped and not experts.stage("act").wrapped
    # The experts are attached to, never patched: no instance attribute replaced, the frozen layout untouched.
    assert "local_experts" not in vars(experts) and experts.layout is layout


def test_patches_come_off_in_any_order():
    module = nn.Linear(2, 2)
    first = _patch.wrap_forward(module, lambda f: lambda x: f(x) + 1, order=_patch.CHECKPOINT)
    second = _patch.wrap_forward(module, lambda f: lambda x: f(x) * 2, order=_patch.INNER)
    x = torch.ones(1, 2)
    plain = nn.functional.linear(x, module.weight, module.bias)
    assert torch.equal(module(x), plain * 2 + 1)  # INNER is applied first, whatever the registration order
    first.remove()
    assert torch.equal(module(x), plain * 2)
    second.remove()
    assert "forward" not in vars(module) and torch.equal(module(x), plain)


class _DropoutLayer(nn.Module):
    """A decoder layer with dropout everywhere (matched by the built-in spec through its child names)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn_norm, self.attn = nn.LayerNorm(16), nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.3))
        self.mlp_norm, self.mlp = nn.LayerNorm(16), nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Tail(nn.Module):
    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.sin(x)  # the last op that saves a tensor
        Tail.calls += 1  # stands for a collective after it
        return y * 2


class _TailLayer(_DropoutLayer):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = Tail()


def test_units_replay_dropout_with_the_forward_random_state():
    def run(callbacks):
        torch.manual_seed(0)
        model = nn.Sequential(*[_DropoutLayer() for _ in range(4)])
        return train(model, callbacks, loss_fn=lambda m, tokens: m(tokens.float()[..., None].expand(-1, -1, 16)).sum())

    reference = run([])
    for num_layers in (2, 4):
        got = run([SelectiveRecompute(granularity="full", num_layers=num_layers)])
        assert equal(got[0], reference[0]) and got[1] < reference[1]


def engine_train(callbacks=(), overlap: bool = False, micro: int = 2) -> list[torch.Tensor]:
    """Two steps of two micro-batches under the overlap engine (one process: the comm points still hand over)."""
    model = gpt()
    runtime = model.layers[0].mlp.experts.runtime
    for cb in callbacks:
        cb.apply(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = OverlapEngine(runtime, overlap=overlap, timeout_s=30)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        tokens = torch.randint(0, VOCAB, (micro, 1, 9), generator=g)
        opt.zero_grad()
        engine.run(lambda i, t=tokens: model._loss(t[i]), lambda i, loss: (loss / micro).backward(), micro)
        opt.step()
    for cb in callbacks:
        cb.remove()
    return [p.detach().clone() for p in model.parameters()]


def test_recompute_under_the_overlap_engine_is_bitwise_equal():
    """Forward of one micro-batch and backward (with the recomputation) of the other in two threads."""
    reference = engine_train()
    for overlap in (True, False):
        for cb in (
            SelectiveRecompute(modules=["a2a_overlap_mlp", "core_attn", "layernorm"]),
            SelectiveRecompute(granularity="full", num_layers=2),
        ):
            assert equal(engine_train([cb], overlap=overlap), reference), (overlap, cb)


def test_router_token_counts_are_not_counted_twice():
    def model():
        torch.manual_seed(0)
        layer = MoEDecoderLayer(
            32, 4, MoELayer(32, 32, 4, 2, score_function="sigmoid", enable_expert_bias=True)
        )
        net = nn.Sequential(layer, MoEDecoderLayer(32, 4, MoELayer(32, 32, 4, 2)))
        apply_expert_parallel(net, None, runtime=CommRuntime())
        return net

    def counts(callbacks):
        net = model()
        train(net, callbacks, steps=1, loss_fn=lambda m, t: m(t.float()[..., None].expand(-1, -1, 32)).sum())
        return net[0].mlp.gate.local_tokens_per_expert.clone()

    reference = counts([])
    assert reference.sum() > 0
    for cb in (SelectiveRecompute(modules=["moe"]), SelectiveRecompute(granularity="full", num_layers=2)):
        assert torch.equal(counts([cb]), reference)


@pytest.mark.parametrize("early_stop_arg", [True, False])
def test_recompute_runs_the_whole_segment(monkeypatch, early_stop_arg):
    """Early stop would end the recomputation at the last saved tensor; a segment ending in communication must
    run to its end on every rank (``early_stop=False``, or an identity saving an empty tensor on older torch)."""
    monkeypatch.setattr(_checkpoint, "_EARLY_STOP_ARG", early_stop_arg)
    Tail.calls = 0

    model = nn.Sequential(_TailLayer())
    cb = SelectiveRecompute(modules=["mlp"])
    cb.apply(model)
    model(torch.randn(2, 16, requires_grad=True)).sum().backward()
    cb.remove()
    assert Tail.calls == 2


def test_hf_layers_map_and_stay_bitwise_equal():
    pytest.importorskip("transformers")
    from lightning_moe_overlap.demo_hf import build_hf_model

    for model_type in ("qwen3_moe", "mixtral"):

        def model(model_type=model_type):
            torch.manual_seed(0)
            m = build_hf_model(model_type)
            apply_expert_parallel(m, None, runtime=CommRuntime())
            return m.train()

        def loss(m, tokens):
            return m(input_ids=tokens, labels=tokens).loss

        layers = find_layers(model())
        assert [layer.qualname for layer in layers] == ["model.layers.0", "model.layers.1"]
        reference = train(model(), loss_fn=loss)
        for cb in (
            SelectiveRecompute(modules=["a2a_overlap_attn", "a2a_overlap_post_attn", "a2a_overlap_mlp", "core_attn"]),
            SelectiveRecompute(granularity="full", num_layers=2),  # HF layers get the KV cache: updated once
        ):
            got = train(model(), [cb], loss_fn=loss)
            assert equal(got[0], reference[0]) and got[1] < reference[1], (model_type, cb)


def test_yaml_class_path_builds_the_callback():
    parser = jsonargparse.ArgumentParser()
    parser.add_argument("--callbacks", type=list[Callback])
    cfg = parser.parse_string(
        "callbacks:\n"
        "  - class_path: lightning_moe_overlap.SelectiveRecompute\n"
        "    init_args: {granularity: full, method: block, num_layers: 2}\n"
        "  - class_path: lightning_moe_overlap.callbacks.SelectiveRecompute\n"
        "    init_args: {modules: [moe_act, a2a_overlap_mlp]}\n"
    )
    first, second = parser.instantiate_classes(cfg).callbacks
    assert (first.granularity, first.method, first.num_layers) == ("full", "block", 2)
    assert second.modules == ("moe_act", "a2a_overlap_mlp")
