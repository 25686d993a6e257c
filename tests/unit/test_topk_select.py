"""``moe/topk_select.py`` against megatron-core's ``topk_routing_with_score_function``, the function it replaces: the
weights and indices read out of megatron-core's dense outputs (the routing map's ``nonzero`` per row, the
probabilities gathered there) are bitwise ours, and so are the gradients of the logits, for every score function,
the group limit, the expert bias, the scaling factor, ``K`` of 1, 2 and 8, float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_moe_overlap.moe.router import TopKRouter, _mcore_moe_utils
from lightning_moe_overlap.moe.topk_select import select_topk

T, E = 37, 16

CASES = {
    "softmax": {},
    "softmax-pre": {"pre_softmax": True},
    "softmax-groups": {"num_groups": 4, "group_topk": 2},
    "softmax-scaled": {"scaling_factor": 2.5},
    "sigmoid": {"score_function": "sigmoid"},
    "sigmoid-bias-groups-scaled": {
        "score_function": "sigmoid",
        "expert_bias": True,
        "num_groups": 4,
        "group_topk": 2,
        "scaling_factor": 2.5,
    },
}


def _megatron(logits: torch.Tensor, top_k: int, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    probs_TE, map_TE = _mcore_moe_utils().topk_routing_with_score_function(logits, top_k, **kwargs)
    rows, experts = map_TE.nonzero(as_tuple=True)  # row-major: each row's experts ascending
    assert torch.equal(rows, torch.arange(logits.shape[0]).repeat_interleave(top_k))
    indices = experts.view(-1, top_k)
    return probs_TE.gather(1, indices), indices


def _kwargs(case: dict, dtype: torch.dtype) -> dict:
    kwargs = dict(case)
    if kwargs.pop("expert_bias", False):
        kwargs["expert_bias"] = torch.randn(E, generator=torch.Generator().manual_seed(3)) * 0.1
    if "pre_softmax" in kwargs:
        kwargs["use_pre_softmax"] = kwargs.pop("pre_softmax")
    return kwargs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("case", list(CASES))
def test_weights_indices_and_gradients_are_bitwise_megatron_cores(case, top_k, dtype):
    kwargs = _kwargs(CASES[case], dtype)
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(top_k)).to(dtype)
    cotangent = torch.randn(T, top_k, generator=torch.Generator().manual_seed(7)).to(dtype)
    results = []
    for run in ("megatron", "ours"):
        x = logits.clone().requires_grad_()
        if run == "megatron":
            weights, indices = _megatron(x, top_k, **kwargs)
        else:
            ours = {("pre_softmax" if k == "use_pre_softmax" else k): v for k, v in kwargs.items()}
            weights, indices = select_topk(x, top_k, mcore=_mcore_moe_utils(), **ours)
        (weights * cotangent).sum().backward()
        results.append((weights.detach(), indices, x.grad))
    (w_ref, i_ref, g_ref), (w, i, g) = results
    assert torch.equal(i, i_ref)
    assert w.dtype == w_ref.dtype and torch.equal(w, w_ref)
    assert torch.equal(g, g_ref)


def test_the_router_counts_each_choice_once_per_expert():
    router = TopKRouter(8, E, 4, score_function="sigmoid", enable_expert_bias=True).train()
    x = torch.randn(T, 8)
    _, _, indices = router(x)
    expected = torch.zeros(E, dtype=torch.int64)
    for expert in indices.flatten().tolist():
        expected[expert] += 1
    assert torch.equal(router.local_tokens_per_expert, expected)


def test_an_unknown_score_function_is_named():
    with pytest.raises(ValueError, match="score_function='relu'"):
        select_topk(torch.zeros(2, E), 2, mcore=_mcore_moe_utils(), score_function="relu")


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_the_router_builds_no_dense_table(score_function):
    """What the selection saves, counted: one ``topk``, and no ``[T, E]`` table scattered and read back."""
    router = TopKRouter(8, E, 2, score_function=score_function).train()
    with _Ops() as ops:
        router(torch.randn(T, 8))
    assert ops.names.count("topk") == 1, ops.names
    assert not {"scatter", "zeros_like", "index_put_"} & set(ops.names), ops.names
