"""The validation rules of ``overlap_grad_reduce`` / ``overlap_param_gather``, the loop's ``before_last_backward``
hook and how the layers that become FSDP units are found (``parallelize/sharding.py``, ``layer_modules``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_moe_overlap.config import OverlapConfig
from lightning_moe_overlap.loop import MicroBatchLoop, StepHooks
from lightning_moe_overlap.parallelize.sharding import layer_modules
from lightning_moe_overlap.step_logs import MicroBatchLogs
from lightning_moe_overlap.validation import check_config, raise_problems


def _check(**kwargs) -> None:
    raise_problems(check_config(OverlapConfig(num_microbatches=2, **kwargs)))


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"overlap_grad_reduce": 1, "shard": "full"}, TypeError, r"`overlap_grad_reduce=1` must be a bool"),
        ({"overlap_param_gather": "yes"}, TypeError, r"`overlap_param_gather='yes'` must be a bool"),
    ],
)
def test_overlap_flag_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        _check(**kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            {"overlap_grad_reduce": True},
            r"`overlap_grad_reduce=True` with `shard='none'` has no effect.*Set `shard='optimizer'` or `shard='full'`",
        ),
        (
            {"overlap_param_gather": True, "shard": "full"},
            r"`overlap_param_gather=True` with `shard='full'` has no effect: the parameters are gathered once per "
            r"step, before the first micro-batch.*Drop `overlap_param_gather`",
        ),
        (
            {"overlap_param_gather": True},
            r"`overlap_param_gather=True` with `shard='none'` has no effect: nothing is gathered",
        ),
    ],
)
def test_overlap_flag_warnings(kwargs, match):
    with pytest.warns(UserWarning, match=match):
        _check(**kwargs)


@pytest.mark.parametrize("shard", ["optimizer", "full"])
def test_overlap_grad_reduce_in_a_sharded_mode_passes_silently(shard, recwarn):
    _check(overlap_grad_reduce=True, shard=shard)
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]


class _Executor:
    def run(self, forward, backward, count):
        losses = [forward(i) for i in range(count)]
        for i, loss in enumerate(losses):
            backward(i, loss)
        return losses


@pytest.mark.parametrize("count", [1, 3])
def test_before_last_backward_runs_once_just_before_the_last_backward(count):
    events = []

    class Module:
        def log(self, *args, **kwargs) -> None:
            pass

    hooks = StepHooks(
        zero_grad=lambda i: None,
        forward=lambda micro, *rest: micro["x"].sum(),
        backward=lambda loss: events.append(("backward",)),
        sync_gradients=lambda: events.append(("sync",)),
        capture_logs=lambda: MicroBatchLogs(Module()),
        before_last_backward=lambda: events.append(("before_last",)),
    )
    MicroBatchLoop(hooks, _Executor(), count).step({"x": torch.ones(count * 2)}, 0)
    assert events == [*[("backward",)] * (count - 1), ("before_last",), ("backward",), ("sync",)]


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2))


class _Layer(nn.Module):
    def __init__(self, experts: bool) -> None:
        super().__init__()
        self.attn = nn.Linear(2, 2)
        self.inner = nn.ModuleList([nn.Linear(2, 2)])  # a list inside a layer: not a layer list
        self.experts = _Experts() if experts else None


def test_layers_are_the_elements_of_a_module_list_holding_experts():
    model = nn.Module()
    model.embed = nn.Embedding(4, 2)
    model.layers = nn.ModuleList([_Layer(True), _Layer(False), _Layer(True)])
    model.heads = nn.ModuleList([nn.Linear(2, 2)])  # no experts: not layers
    experts = [model.layers[0].experts, model.layers[2].experts]
    assert layer_modules(model, experts) == [model.layers[0], model.layers[2]]
    assert layer_modules(model, []) == []


def test_a_pipeline_chunks_layers_in_a_module_dict_are_layers_too():
    """A pipeline chunk keeps its layers in an ``nn.ModuleDict`` under their unsplit indices (the splitters)."""
    chunk = nn.Module()
    chunk.layers = nn.ModuleDict({"2": _Layer(True), "3": _Layer(False)})
    assert layer_modules(chunk, [chunk.layers["2"].experts]) == [chunk.layers["2"]]


def test_autograd_calls_the_hook_of_a_parameter_whose_weight_gradient_is_deferred():
    """Why the early reduction leaves deferred-wgrad experts out of its order (``grad_reduce.py``): a backward that
    returns no gradient for a weight (the deferred path) still calls its post-accumulate hook, before the deferred
    gradient lands; armed like the others, such a unit would look final too early."""

    class Deferred(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2, None

    weight = nn.Parameter(torch.ones(3))
    seen: list[object] = []
    weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad))
    Deferred.apply(torch.ones(3, requires_grad=True), weight.view(3)).sum().backward()
    assert seen == [None]


def test_overlap_grad_reduce_composes_with_tensor_parallelism():
    """Each unit's tp replicas are summed just before its early reduction (``TensorParallelGrads.unit_reducer``)."""
    _check(overlap_grad_reduce=True, shard="full", tp=2)
    _check(overlap_grad_reduce=True, shard="optimizer", tp=2)
