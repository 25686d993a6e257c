"""The offload engine's CUDA path: pinned host buffers, copies on their own streams, bitwise equal to no offload."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_moe_overlap.callbacks import ActivationOffload, SavedActivationMeter, SelectiveRecompute
from lightning_moe_overlap.callbacks.numa import bind_to_device_numa_node
from lightning_moe_overlap.callbacks.offload_engine import CudaCopier
from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.moe.ep import apply_expert_parallel
from lightning_moe_overlap.overlap import CommRuntime, run_schedule

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="Requires: CUDA (streams, pinned memory)"),
]
TAGS = ["dispatched_input", "pre_mlp_layernorm_output"]
MODULES = ["attn_norm", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act"]


def _train(callbacks=(), overlap: bool = True) -> list[torch.Tensor]:
    model = MoEGPT(vocab_size=64, hidden_size=64, num_layers=3, num_experts=4, ffn_hidden_size=64).cuda()
    runtime = CommRuntime()
    apply_expert_parallel(model, None, runtime=runtime)
    for cb in callbacks:
        cb.apply(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        tokens = torch.randint(0, 64, (2, 4, 33), generator=g).cuda()
        opt.zero_grad()
        forward = lambda i, t=tokens: model._loss(t[i])
        run_schedule(forward, lambda i, loss: (loss / 2).backward(), 2, runtime, overlap=overlap)
        opt.step()
    for cb in callbacks:
        cb.remove()
    return [p.detach().cpu() for p in model.parameters()]


@pytest.fixture
def deterministic():
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(False)


def test_cuda_offload_is_bitwise_and_uses_the_cuda_copier(deterministic):
    reference = _train(overlap=False)
    for overlap in (True, False):
        cb = ActivationOffload(modules=MODULES, tensors=TAGS, min_tensor_size=0)
        params = _train([cb], overlap=overlap)
        assert all(torch.equal(a, b) for a, b in zip(params, reference))
        assert isinstance(cb.engine.copier(torch.device("cuda", torch.cuda.current_device())), CudaCopier)
        assert cb.engine.stats.offloaded_bytes > 0
        full = SelectiveRecompute(granularity="full", num_layers=2)
        both = [full, ActivationOffload(tensors=TAGS, min_tensor_size=0)]
        params = _train(both, overlap=overlap)
        assert all(torch.equal(a, b) for a, b in zip(params, reference))


def test_cuda_host_copies_are_pinned():
    copier = CudaCopier(torch.device("cuda", torch.cuda.current_device()))
    src = torch.arange(1 << 16, dtype=torch.uint8, device="cuda")
    host, event = copier.to_host(src)
    dev, done = copier.to_device(host, src.device, event)
    copier.ready(dev, done)
    assert host.is_pinned() and torch.equal(dev, src)


def test_numa_bind_binds_or_says_why():
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        cpus = bind_to_device_numa_node(torch.device("cuda", torch.cuda.current_device()))
    assert (cpus is None) == any("binding skipped" in str(r.message) for r in records)


def test_meter_runs_on_cuda():
    x = torch.randn(256, 256, device="cuda", requires_grad=True)
    with SavedActivationMeter() as meter:
        y = torch.sin(x * 2)  # saves x * 2 (the scalar product saves nothing)
    assert meter.held_bytes() == 256 * 256 * 4
    y.sum().backward()
