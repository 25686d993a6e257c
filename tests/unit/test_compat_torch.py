"""The private torch names of ``_compat`` still exist and behave (a failure here names the torch version)."""

from __future__ import annotations

import torch

from lightning_moe_overlap._compat import torch as torch_compat


def test_private_torch_names_exist() -> None:
    for name in ("_foreach_norm", "_foreach_mul_"):
        assert hasattr(torch, name), f"torch {torch.__version__} has no `torch.{name}`; update `_compat`"
    assert hasattr(torch.cuda, "_sleep"), f"torch {torch.__version__} has no `torch.cuda._sleep`; update `_compat`"


def test_foreach_helpers_match_the_plain_ops() -> None:
    tensors = [torch.arange(4.0), torch.full((2, 3), -2.0)]
    norms = torch_compat.foreach_norm(tensors, 2.0, dtype=torch.float64)
    assert [n.dtype for n in norms] == [torch.float64] * 2
    assert torch.equal(torch.stack(norms), torch.stack([t.double().norm() for t in tensors]))
    torch_compat.foreach_mul_(tensors, torch.tensor(0.5))
    assert torch.equal(tensors[0], torch.arange(4.0) / 2) and torch.equal(tensors[1], torch.full((2, 3), -1.0))
