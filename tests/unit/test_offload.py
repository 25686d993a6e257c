"""``ActivationOffload`` and its engine in one process: validation, what moves, bitwise-equal training, NUMA.

On CPU the engine runs its CPU twin (copies into a separate buffer), the same code path as on a GPU except for
the copier. The distributed twin is tests/distributed/test_memory.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import jsonargparse
import pytest
import torch
from lightning.pytorch import Callback
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_moe_overlap._compat import torch as torch_compat
from lightning_moe_overlap.callbacks import (
    ActivationOffload,
    OffloadEngine,
    Output,
    SavedActivationMeter,
    SelectiveRecompute,
    _forward_regions,
    register_layer_names,
    unregister_layer_names,
)
from lightning_moe_overlap.callbacks.numa import bind_to_device_numa_node, numa_cpus, parse_cpulist
from lightning_moe_overlap.demo import MoEDecoderLayer
from tests.unit.test_recompute import VOCAB, engine_train, equal, gpt, one_thread, train  # noqa: F401 (fixture)

TAGS = ["dispatched_input", "pre_mlp_layernorm_output"]
MODULES = ["attn_norm", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act"]


@pytest.fixture(scope="module")
def reference() -> tuple[list[torch.Tensor], int]:
    return train(gpt())


# -- validation --------------------------------------------------------------------------------------------------
def test_constructor_rejects_bad_values():
    with pytest.raises(ValueError, match=r"modules and tensors are both empty, so nothing would be offloaded"):
        ActivationOffload()
    with pytest.raises(ValueError, match=r"tensors has unknown name\(s\) \['expert_fc1'\]; the valid names are"):
        ActivationOffload(tensors=["expert_fc1"])
    with pytest.raises(ValueError, match=r"modules has unknown name\(s\) \['qkv'\]"):
        ActivationOffload(modules=["qkv"])
    with pytest.raises(TypeError, match=r"tensors='dispatched_input' must be a list of names"):
        ActivationOffload(tensors="dispatched_input")
    with pytest.raises(ValueError, match=r"has 'attn_proj' without 'core_attn'.*Add 'core_attn'"):
        ActivationOffload(modules=["attn_proj"])
    with pytest.raises(ValueError, match=r"min_tensor_size=-1 must be a non-negative number of bytes"):
        ActivationOffload(tensors=TAGS, min_tensor_size=-1)


def test_apply_rejects_what_the_model_does_not_have():
    with pytest.raises(ValueError, match=r"tensors \['dispatched_input'\] are not in this model.*expert-parallel"):
        ActivationOffload(tensors=TAGS).apply(gpt(ep=False))
    with pytest.raises(ValueError, match=r"no decoder layer recognised in Linear"):
        ActivationOffload(tensors=TAGS).apply(nn.Linear(2, 2))
    spec = register_layer_names(MoEDecoderLayer, {"norm_out": Output("mlp_norm")}, name="test_offload_kinds")
    try:
        with pytest.raises(ValueError, match=r"modules has \['norm_out'\], which name tensors.*under `tensors`"):
            ActivationOffload(modules=["norm_out"]).apply(gpt())
    finally:
        unregister_layer_names(spec)


# -- what moves --------------------------------------------------------------------------------------------------
def test_offloading_the_tagged_tensors_frees_at_least_their_size(reference):
    """The LoongForge recipe: ``--offload-tensors dispatched_input pre_mlp_layernorm_output``."""
    cb = ActivationOffload(tensors=TAGS, min_tensor_size=0)
    params, held = train(gpt(), [cb])
    tokens, top_k, hidden, layers = 2 * 8, 2, 32, 3
    dispatched = tokens * top_k * hidden * 4  # ep=1, dropless: every (token, choice) row, float32
    norm_out = tokens * hidden * 4
    assert reference[1] - held >= layers * (dispatched + norm_out)
    assert equal(params, reference[0])
    assert cb.engine.stats.offloaded_tensors == 2 * layers * 2  # per step: two storages per layer
    assert cb.engine.stats.reloaded_bytes == cb.engine.stats.offloaded_bytes


@pytest.mark.parametrize("names", [[m] for m in MODULES if m != "attn_proj"] + [["core_attn", "attn_proj"], MODULES])
def test_each_module_is_offloaded_bitwise(reference, names):
    cb = ActivationOffload(modules=names, min_tensor_size=0)
    params, held = train(gpt(), [cb])
    assert equal(params, reference[0])
    assert cb.engine.stats.offloaded_bytes > 0 and held < reference[1]


def test_min_tensor_size_keeps_small_tensors(reference):
    cb = ActivationOffload(tensors=TAGS, modules=MODULES)  # 1 MiB: larger than anything in this model
    params, held = train(gpt(), [cb])
    assert cb.engine.stats.offloaded_bytes == 0 and held == reference[1] and equal(params, reference[0])


def test_nothing_is_offloaded_inside_a_checkpoint(reference):
    """A layer the user checkpoints saves nothing to offload; forward and recomputation agree on it."""
    model = gpt()

    def loss(m, tokens):
        x = m.embed(tokens[:, :-1])
        for layer in m.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        logits = m.head(m.norm(x))
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    cb = ActivationOffload(tensors=TAGS, modules=MODULES, min_tensor_size=0)
    params, _ = train(model, [cb], loss_fn=loss)
    assert cb.engine.stats.offloaded_bytes == 0
    assert equal(params, reference[0])


def test_offload_and_recompute_together(reference):
    cbs = [SelectiveRecompute(modules=["core_attn", "moe_act"]), ActivationOffload(tensors=TAGS, min_tensor_size=0)]
    params, held = train(gpt(), cbs)
    assert equal(params, reference[0]) and held < reference[1]


@pytest.mark.parametrize("first", [0, 1])
def test_offload_and_recompute_come_off_in_any_order(reference, first):
    model = gpt()
    cbs = [
        SelectiveRecompute(modules=["a2a_overlap_mlp", "moe_act", "core_attn"]),
        ActivationOffload(tensors=TAGS, modules=MODULES, min_tensor_size=0),
    ]
    for cb in cbs:
        cb.apply(model)
    experts = [layer.mlp.experts for layer in model.layers]
    assert all(e.stage("local").wrapped and e.stage("act").wrapped for e in experts)
    cbs[first].remove()
    cbs[1 - first].remove()
    assert not any(e.stage(name).wrapped for e in experts for name in ("local", "fc1", "act", "fc2"))
    assert not any("forward" in vars(m) for m in model.modules())
    params, held = train(model)  # nothing left attached: the plain run's memory and parameters
    assert held == reference[1] and equal(params, reference[0])


def test_offload_under_the_overlap_engine_is_bitwise_equal():
    """Hooks are installed in the forward's thread; the reload happens in the backward's."""
    ref = engine_train()
    for overlap in (True, False):
        cbs = [ActivationOffload(tensors=TAGS, modules=MODULES, min_tensor_size=0)]
        assert equal(engine_train(cbs, overlap=overlap), ref)
        full = SelectiveRecompute(granularity="full", num_layers=2)
        both = [full, ActivationOffload(tensors=TAGS, min_tensor_size=0)]
        assert equal(engine_train(both, overlap=overlap), ref)


def test_hf_qwen3_offload_is_bitwise():
    pytest.importorskip("transformers")
    from lightning_moe_overlap.demo_hf import build_hf_model
    from lightning_moe_overlap.moe.ep import apply_expert_parallel
    from lightning_moe_overlap.overlap.runtime import CommRuntime

    def model():
        torch.manual_seed(0)
        m = build_hf_model("qwen3_moe")
        apply_expert_parallel(m, None, runtime=CommRuntime())
        return m.train()

    def loss(m, tokens):
        return m(input_ids=tokens, labels=tokens).loss

    reference = train(model(), loss_fn=loss)
    cb = ActivationOffload(tensors=TAGS, modules=MODULES, min_tensor_size=0)
    params, held = train(model(), [cb], loss_fn=loss)
    assert equal(params, reference[0]) and held < reference[1]


# -- the engine --------------------------------------------------------------------------------------------------
def test_engine_copies_a_storage_once_and_is_bitwise():
    weight = nn.Parameter(torch.randn(6, 6))
    base = torch.randn(4, 18)

    def run(engine: OffloadEngine | None) -> tuple[torch.Tensor, torch.Tensor]:
        weight.grad = None
        x = base.clone().requires_grad_()
        if engine is not None:
            engine.open_group()
        with _forward_regions.region("core_attn"):
            q, k, v = (x * 1.5).unflatten(-1, (3, 6)).unbind(-2)  # three strided views of one storage
            out = (q * k).sum() + (v @ weight).sum()  # saves q, k, v and the parameter
        if engine is not None:
            engine.close_group()
        out.backward()
        return x.grad, weight.grad.clone()

    engine = OffloadEngine(modules=["core_attn"], tensors=[], min_tensor_size=0, exclude=[weight])
    got, expected = run(engine), run(None)
    assert engine.stats.offloaded_tensors == 1  # one storage for three views; the parameter stays
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_engine_unpacks_views_with_their_layout():
    engine = OffloadEngine(modules=["r"], tensors=[], min_tensor_size=0)
    x = torch.randn(5, 8, requires_grad=True)
    y = torch.randn(8, 5)[1:4].t()  # a non-contiguous view with an offset
    engine.open_group()
    with _forward_regions.region("r"):
        z = x[:, 1:4] * y
    engine.close_group()
    other = z.grad_fn._saved_other  # unpacks: a reloaded copy
    assert other.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()
    assert torch.equal(other, y) and other.stride() == y.stride() and other.storage_offset() == y.storage_offset()


def test_engine_prefetches_the_previous_layer():
    engine = OffloadEngine(modules=["r"], tensors=[], min_tensor_size=0)
    h = torch.randn(3, 4, requires_grad=True) * 2
    groups = []
    for _ in range(3):
        engine.open_group()
        groups.append(engine._stack()[-1])
        with _forward_regions.region("r"):
            h = torch.sin(h)  # saves its input
        engine.close_group()
    loaded = [[ref().loaded is not None for ref in g.entries] for g in groups]
    assert loaded == [[False], [False], [False]]
    _ = h.grad_fn._saved_self  # backward reaches the last layer: the one before it is reloaded ahead
    loaded = [[ref().loaded is not None for ref in g.entries] for g in groups]
    assert loaded == [[False], [True], [True]]


def test_inside_checkpoint_sees_the_innermost_saved_tensors_hooks():
    """The offload skips groups inside a checkpoint; it asks torch which saved-tensor hooks are on top."""
    assert hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks"), (
        f"torch {torch.__version__} has no `torch._C._autograd._top_saved_tensors_default_hooks`; update "
        "`_compat/torch.py::top_saved_tensors_hooks`"
    )
    assert torch_compat.top_saved_tensors_hooks() is None and not _forward_regions.inside_checkpoint()
    seen = []

    def segment(x):
        seen.append(_forward_regions.inside_checkpoint())
        return x.sin()

    checkpoint(segment, torch.ones(2, requires_grad=True), use_reentrant=False).sum().backward()
    with torch.autograd.graph.saved_tensors_hooks(_same, _same):
        assert torch_compat.top_saved_tensors_hooks()[0] is _same and not _forward_regions.inside_checkpoint()
    assert seen == [True, True]  # the forward and the recomputation


def _same(t):
    return t


def test_meter_counts_distinct_live_storages():
    x = torch.randn(10, 10, requires_grad=True)
    with SavedActivationMeter() as meter:
        y = torch.sin(x)  # saves x
        z = torch.cos(y)  # saves y
        w = y * y  # saves y twice: one storage
    assert meter.held_bytes() == 2 * 400
    del y, z, w  # the graph is gone: only x, which the caller still holds, remains
    assert meter.held_bytes() == 400 and meter.offloaded_bytes() == 0


# -- NUMA, warnings, YAML ----------------------------------------------------------------------------------------
def test_numa_parsing_and_lookup(tmp_path):
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    address = "0000:1b:00.0"
    (tmp_path / "bus/pci/devices" / address).mkdir(parents=True)
    (tmp_path / "bus/pci/devices" / address / "numa_node").write_text("1\n")
    (tmp_path / "devices/system/node/node1").mkdir(parents=True)
    (tmp_path / "devices/system/node/node1/cpulist").write_text("16-19,48\n")
    assert numa_cpus(address, tmp_path) == {16, 17, 18, 19, 48}
    assert numa_cpus("0000:ff:00.0", tmp_path) is None
    (tmp_path / "bus/pci/devices" / address / "numa_node").write_text("-1\n")
    assert numa_cpus(address, tmp_path) is None


def test_numa_bind_is_skipped_with_a_warning_without_a_gpu():
    with pytest.warns(UserWarning, match=r"binding skipped: the device is 'cpu', not a GPU"):
        assert bind_to_device_numa_node(torch.device("cpu")) is None


def test_warns_when_recompute_leaves_nothing_to_offload():
    offload = ActivationOffload(tensors=TAGS, modules=["core_attn"])
    trainer = SimpleNamespace(callbacks=[SelectiveRecompute(modules=["a2a_overlap_mlp", "core_attn"]), offload])
    with pytest.warns(UserWarning, match=r"\['core_attn', 'dispatched_input'\] are inside modules that"):
        offload._warn_if_recomputed(trainer)  # type: ignore[arg-type]


def test_yaml_class_path_builds_the_callback():
    parser = jsonargparse.ArgumentParser()
    parser.add_argument("--callbacks", type=list[Callback])
    cfg = parser.parse_string(
        "callbacks:\n"
        "  - class_path: lightning_moe_overlap.ActivationOffload\n"
        "    init_args: {tensors: [dispatched_input, pre_mlp_layernorm_output], min_tensor_size: 0, numa_bind: true}\n"
    )
    (cb,) = parser.instantiate_classes(cfg).callbacks
    assert cb.tensors == tuple(TAGS) and cb.min_tensor_size == 0 and cb.numa_bind
