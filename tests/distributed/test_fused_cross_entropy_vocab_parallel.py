"""The fused linear cross-entropy with a vocabulary-parallel head on 2 gloo ranks: each rank holds half the rows of
the head (and of its bias), the max, sum of exponentials and target logit are combined over the group, and the
loss, the full gradient of hidden (on every rank) and each rank's rows of the weight and bias gradients equal the
unsharded oracle (``F.cross_entropy`` of the full logits in one process) within bounds derived from float32
arithmetic (``cross_entropy_bounds``, ``tests/helpers/tolerance.py``: the chain of sums the two compute in other
orders, per gradient entry), for block sizes that divide the shard and ones that do not, both reductions, ignored
tokens, and targets that all live on one rank.
"""

from __future__ import annotations

import pytest

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_moe_overlap.loss import fused_linear_cross_entropy
from tests.helpers.distributed import run_distributed
from tests.helpers.tolerance import blocks_of, cross_entropy_bounds

pytestmark = pytest.mark.long  # a variant matrix: `pytest -m long` (docs/benchmarks.md, Tests)

T, D, V = 29, 12, 2 * 53  # 53 rows per rank
CASES = [  # (chunk_size, reduction, targets)
    (7, "mean", "any"), (53, "sum", "any"), (3072, "mean", "any"), (10, "mean", "rank1"), (4, "sum", "rank0"),
]


def _full(case: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(case)
    h = torch.randn(T, D, generator=g)
    w = torch.randn(V, D, generator=g) * 0.5
    b = torch.randn(V, generator=g) * 0.1
    target = torch.randint(0, V, (T,), generator=g)
    return h, w, b, target


def _targets(target: torch.Tensor, where: str) -> torch.Tensor:
    half = V // 2
    if where == "rank0":
        target = target % half
    elif where == "rank1":
        target = half + target % half
    target = target.clone()
    target[::3] = -100
    return target


def _errors(rank: int, world: int) -> list[dict[str, float]]:
    group = dist.new_group(list(range(world)))
    rows = slice(rank * V // world, (rank + 1) * V // world)
    errors = []
    for case, (chunk_size, reduction, where) in enumerate(CASES):
        h, w, b, target = _full(case)
        target = _targets(target, where)
        h_full, w_full, b_full = (t.clone().requires_grad_() for t in (h, w, b))
        want = F.cross_entropy(F.linear(h_full, w_full, b_full), target, reduction=reduction)
        want.backward()
        h_mine, w_mine, b_mine = h.clone().requires_grad_(), w[rows].clone().requires_grad_(), b[rows].clone()
        b_mine.requires_grad_()
        got = fused_linear_cross_entropy(
            h_mine, w_mine, target, bias=b_mine, chunk_size=chunk_size, reduction=reduction, group=group
        )
        got.backward()
        # the normaliser: each rank's blocks, and the combination over the ranks rescales each rank's sum once more
        blocks = world * (blocks_of(V // world, chunk_size) + 1)
        bounds = cross_entropy_bounds(h, w, b, target, reduction=reduction, blocks=blocks)
        rtol, atol = bounds["loss"]

        def over(a: torch.Tensor, o: torch.Tensor, bound: torch.Tensor) -> float:
            """The largest ``|a - o| / bound`` (0 / 0: 0): at most 1 within the bound."""
            return ((a.double() - o.double()).abs() / bound.double()).nan_to_num(0.0, posinf=float("inf")).max().item()

        errors.append({
            "loss": abs(got.item() - want.item()) / (atol + rtol * abs(want.item())),
            "hidden": over(h_mine.grad, h_full.grad, bounds["h"]),
            "weight": over(w_mine.grad, w_full.grad[rows], bounds["w"][rows]),
            "bias": over(b_mine.grad, b_full.grad[rows], bounds["b"][rows]),
        })  # fmt: skip
    return errors


def test_vocab_parallel_head_matches_unsharded_loss() -> None:
    results = run_distributed(_errors, 2)
    for rank, errors in enumerate(results):
        for case, found in zip(CASES, errors, strict=True):
            assert max(found.values()) <= 1.0, (rank, case, found)  # each difference over its bound
