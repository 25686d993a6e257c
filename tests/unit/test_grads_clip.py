"""Clipping by the global norm stays on the device: no host sync around the ep all-reduce, one collective per group.

On NCCL a ``.cpu()`` before the all-reduce would hand a CPU tensor to an NCCL group (an error), and one host sync
per parameter stalls the CPU behind the GPU. Here every syncing tensor method is counted while clipping runs with a
pretended 2-rank ep group; the collective is recorded instead of run.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_moe_overlap.parallel.grads import allreduce_mean, clip_grad_norm, global_grad_norm

SYNCING_METHODS = ("cpu", "item", "tolist", "numpy", "__float__", "__int__", "__bool__")


def _params(seed: int, shapes: list[tuple[int, ...]], dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(dtype)
    return params


@pytest.fixture
def syncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the syncing tensor methods called while the test runs."""
    calls: list[str] = []
    for name in SYNCING_METHODS:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _name=name, _original=original, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    return calls


@pytest.fixture
def two_rank_ep(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Pretend an initialised 2-rank ep group; ``all_reduce`` records its tensor and doubles it (a peer with the
    same expert gradients)."""
    reduced: list[torch.Tensor] = []

    def all_reduce(tensor: torch.Tensor, group: object = None, **_: object) -> None:
        reduced.append(tensor)
        tensor.mul_(2)

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return reduced


def test_allreduce_mean_buckets_by_dtype_and_writes_every_gradient_back(two_rank_ep: list[torch.Tensor]) -> None:
    grads = [p.grad for p in _params(0, [(4, 3), (3,)]) + _params(1, [(5,)], torch.float64) + _params(2, [(2, 3)])]
    grads[-1] = grads[-1].t()  # a non-contiguous gradient, alone in its bucket
    expected = [g / 2 for g in grads]  # the fake peer doubles: sum over 2 ranks of the same gradient, / 4
    allreduce_mean(grads, group=None, divisor=4)  # type: ignore[arg-type]
    assert [t.dtype for t in two_rank_ep] == [torch.float32, torch.float64, torch.float32]  # one collective per run
    assert two_rank_ep[1].data_ptr() == grads[2].data_ptr()  # a lone contiguous gradient is reduced in place
    assert all(g.dtype == e.dtype and torch.equal(g, e) for g, e in zip(grads, expected))


def test_clip_has_no_host_sync_and_one_collective(syncs: list[str], two_rank_ep: list[torch.Tensor]) -> None:
    """Plain gradients are replicas over the ``block`` ranks of a model copy: each rank adds ``1/block`` of their
    squares, and the one all-reduce over the world (here two ranks with the same gradients) sums them back."""
    params = _params(0, [(4, 3), (3,)]) + _params(1, [(5,)], torch.float64) + _params(2, [(2, 4, 3)])
    want_sq = sum(p.grad.double().square().sum() for p in params)
    grads_before = [p.grad.clone() for p in params]

    norm = clip_grad_norm(params, 1.0, block=2, device=torch.device("cpu"))

    assert syncs == []
    assert len(two_rank_ep) == 1 and two_rank_ep[0].dtype == torch.float64 and two_rank_ep[0].dim() == 0
    assert isinstance(norm, torch.Tensor) and norm.dtype == torch.float64
    torch.testing.assert_close(norm, want_sq.sqrt(), rtol=1e-12, atol=0)
    coef = 1.0 / (want_sq.sqrt() + 1e-6)
    for p, before in zip(params, grads_before, strict=True):
        torch.testing.assert_close(p.grad, before * coef.to(before.dtype))


def test_norm_matches_torch_clip_grad_norm_single_process() -> None:
    params = _params(6, [(8, 8), (8,)]) + _params(7, [(4, 8, 2)], torch.float64)
    reference = [nn.Parameter(p.detach().clone()) for p in params]
    for r, p in zip(reference, params, strict=True):
        r.grad = p.grad.clone()
    want = torch.nn.utils.clip_grad_norm_(reference, 0.5)
    got = clip_grad_norm(params, 0.5, block=1, device=torch.device("cpu"))
    torch.testing.assert_close(got.float(), want.float())
    for r, p in zip(reference, params, strict=True):
        torch.testing.assert_close(p.grad, r.grad)


def test_below_max_norm_leaves_gradients_bitwise_unchanged() -> None:
    params = _params(5, [(3, 3)])
    before = params[0].grad.clone()
    clip_grad_norm(params, 1e6, block=1, device=torch.device("cpu"))
    assert torch.equal(params[0].grad, before)


def test_no_gradients_gives_zero_norm_on_the_requested_device() -> None:
    norm = global_grad_norm([nn.Parameter(torch.zeros(2))], block=1, device=torch.device("cpu"))
    assert norm.device.type == "cpu" and norm.dtype == torch.float64
    assert torch.equal(norm, torch.zeros((), dtype=torch.float64))
