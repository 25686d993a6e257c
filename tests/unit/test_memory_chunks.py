"""The memory callbacks on a pipeline rank's chunks: ``apply(chunks)`` finds the layers of the built-in chunk modules,
covers every chunk in one call, and counts full-recompute layers per chunk (units never span two chunks).

Chunks run as torch's pipelining runs them: the second chunk gets the first one's output detached (a received
activation), and the first chunk's backward starts from the gradient the second one computed for it.
The distributed twin (pp=2 x ep=2, interleaved 1F1B and DualPipeV, overlap on and off) is
tests/distributed/test_pipeline_overlap.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_moe_overlap.callbacks import ActivationOffload, SelectiveRecompute, find_layers
from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.moe.ep import apply_expert_parallel
from lightning_moe_overlap.overlap.runtime import CommRuntime
from lightning_moe_overlap.config.pipeline_layout import build_layout
from lightning_moe_overlap.pipeline.split import SplitModel, split_model

VOCAB = 64


def gpt_split(layers: int = 4, pp: int = 2) -> tuple[MoEGPT, SplitModel]:
    """A tiny MoE GPT made expert-parallel (ep=1) and cut into ``pp`` chunks of ``layers / pp`` layers."""
    torch.manual_seed(0)
    model = MoEGPT(vocab_size=VOCAB, hidden_size=16, num_layers=layers, num_heads=2, num_experts=4, ffn_hidden_size=16)
    apply_expert_parallel(model, None, runtime=CommRuntime())
    return model, split_model(model, build_layout(num_layers=layers, pp=pp, vpp=1))


def pipelined_grads(model: nn.Module, split: SplitModel) -> list[torch.Tensor]:
    """One micro-batch through the chunks as pipeline stages; the gradients of every parameter."""
    model.zero_grad()
    args, target = split.prepare_batch(torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1)))
    outputs, inputs = [], [args[0]]
    for c, chunk in enumerate(split.chunks):
        outputs.append(chunk(inputs[-1]))
        if c + 1 < len(split.chunks):
            inputs.append(outputs[-1].detach().requires_grad_())
    split.loss_fn(outputs[-1], target).backward()
    for c in range(len(split.chunks) - 2, -1, -1):
        outputs[c].backward(inputs[c + 1].grad)
    return [p.grad.clone() for p in model.parameters()]


def norm_calls(model: MoEGPT) -> list[int]:
    """Per layer, how often its ``mlp_norm`` will run (forward and recomputations): counters to read later."""
    counts = [0] * len(model.layers)
    for i, layer in enumerate(model.layers):
        layer.mlp_norm.register_forward_pre_hook(lambda m, a, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts


def test_find_layers_in_built_in_chunks():
    model, split = gpt_split()
    assert [[layer.qualname for layer in find_layers(chunk)] for chunk in split.chunks] == [
        ["layers.0", "layers.1"], ["layers.2", "layers.3"]
    ]
    assert [layer.module for chunk in split.chunks for layer in find_layers(chunk)] == list(model.layers)


def test_find_layers_in_hf_chunks():
    pytest.importorskip("transformers", reason="Requires: transformers>=5")
    from lightning_moe_overlap.demo_hf import HFMoECausalLM

    with torch.device("meta"):
        model = HFMoECausalLM("qwen3_moe", config_overrides={"num_hidden_layers": 4})
    split = split_model(model, build_layout(num_layers=4, pp=2, vpp=2))
    assert [[layer.qualname for layer in find_layers(chunk)] for chunk in split.chunks] == [
        [f"model.layers.{i}"] for i in range(4)
    ]


@pytest.mark.parametrize(
    "callback",
    [
        lambda: SelectiveRecompute(modules=["a2a_overlap_attn", "moe_act"]),
        lambda: SelectiveRecompute(granularity="full", method="uniform", num_layers=2),
        lambda: ActivationOffload(modules=["expert_fc1"], tensors=["dispatched_input"], min_tensor_size=0),
    ],
    ids=["selective", "full", "offload"],
)
def test_apply_to_chunks_covers_every_chunk_and_changes_no_gradient(callback):
    model, split = gpt_split()
    reference = pipelined_grads(model, split)
    counts = norm_calls(model)
    cb = callback()
    engine = cb.apply(list(split.chunks))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a full-recompute unit spanning two chunks would warn
        got = pipelined_grads(model, split)
    cb.remove()
    assert all(torch.equal(a, b) for a, b in zip(got, reference))
    if isinstance(cb, ActivationOffload):
        assert engine.stats.offloaded_tensors >= len(model.layers)  # at least the dispatched rows of every layer
        assert engine.stats.reloaded_bytes == engine.stats.offloaded_bytes
    elif cb.granularity == "full":
        # units (0, 1) and (2, 3): a unit's first layer runs in the forward, in the replay that rebuilds the second
        # layer's input, and in its own recomputation; the second layer in the forward and its recomputation
        assert counts == [3, 2, 3, 2]
    else:
        assert counts == [1] * len(model.layers)  # the norm before the MLP is not recomputed


def test_full_recompute_counts_layers_per_chunk():
    model, split = gpt_split()
    counts = norm_calls(model)
    cb = SelectiveRecompute(granularity="full", method="block", num_layers=1)
    cb.apply(list(split.chunks))
    pipelined_grads(model, split)
    cb.remove()
    assert counts == [2, 1, 2, 1]  # the first layer of each chunk (Megatron's block count per pipeline stage)

    # uniform units larger than a chunk: each chunk is one unit, with no warning (the unsplit model would chain
    # layers 1 and 2, which live in different chunks, and warn when the pipeline hands a detached tensor over)
    cb = SelectiveRecompute(granularity="full", method="uniform", num_layers=3)
    cb.apply(list(split.chunks))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipelined_grads(model, split)
    cb.remove()
    cb.apply(model)
    with pytest.warns(UserWarning, match="was not called with the previous layer's output"):
        pipelined_grads(model, split)
    cb.remove()


def test_apply_to_chunks_errors():
    _, split = gpt_split()
    with pytest.raises(ValueError, match=r"num_layers=3, but the largest of its chunks has 2 decoder layers"):
        SelectiveRecompute(granularity="full", method="block", num_layers=3).apply(list(split.chunks))
    with pytest.raises(ValueError, match=r"no decoder layer recognised in chunks \['Linear', 'Linear'\]"):
        SelectiveRecompute(modules=["mlp"]).apply([nn.Linear(2, 2), nn.Linear(2, 2)])
    with pytest.raises(TypeError, match=r"apply: got list .*non-empty list of modules"):
        SelectiveRecompute(modules=["mlp"]).apply([])
    with pytest.raises(TypeError, match=r"`ActivationOffload`.apply: got str"):
        ActivationOffload(tensors=["dispatched_input"]).apply("model")
