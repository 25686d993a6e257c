"""1F1B with one stage per rank, its steady state in overlapped pairs: the compute order of every rank.

In 1F1B's steady state a stage alternates the forward of micro-batch ``j`` and the backward of micro-batch ``i < j``;
the two do not depend on each other, only on what the neighbouring stages send (``j``'s activations from the stage
before, ``i``'s gradient from the stage after). Here each such step is one ``OVERLAP_F_B`` action (the engine's two
contexts, the all-to-alls of one hidden under the compute of the other), once both inputs are on the rank.

The order of stage ``s`` (rank ``s`` of the pp group), with ``pp`` stages and ``M`` micro-batches::

    w = min(2 (pp - 1 - s) + 1, M)                     forwards before the first backward ("warm-up")
    F0 .. F(w-1),  (F(w) | B0), (F(w+1) | B1), ...,  (F(M-1) | B(M-1-w)),  B(M-w) .. B(M-1)

Why ``2 (pp - 1 - s) + 1`` and not plain 1F1B's ``pp - 1 - s``. The pair ``k`` of stage ``s`` needs ``B(k)``'s
gradient, which the pair ``k`` of stage ``s + 1`` produces; that pair needs ``F(w(s+1) + k)``'s activations from
stage ``s``. With warm-ups one apart (one more micro-batch in flight on every stage) that forward is in pair ``k - 1``
of stage ``s``: neighbours wait for each other's pair in turn, each busy half the time. Two apart (``w(s) = w(s+1) +
2``), it is in pair ``k - 2``: a pair of ``s`` and a pair of ``s + 1`` run at the same time, and the steady state is
full. The last stage runs ``F0`` first (its ``B0`` needs ``F0``'s loss), then pairs ``F(k+1)`` with ``B(k)``.

The cost is activation memory: stage ``s`` holds up to ``w + 1`` micro-batches' activations where plain 1F1B holds
``pp - s`` (the first stage ``2 pp`` against ``pp``; the last one 2 against 1). Stage ``s`` pairs only when
``M > w``: every stage runs a pair from ``M = 2 pp`` on; below it the first stages run plain 1F1B's tail only.

Every stage runs the same forwards and backwards as 1F1B, and its backwards in the same order (``B0`` first), so the
gradients accumulate in 1F1B's order: the overlapped step is bitwise the plain one.
"""

from __future__ import annotations

from typing import Any

from lightning_moe_overlap._compat import torch as torch_compat


def warmup(pp: int, stage: int, num_microbatches: int) -> int:
    """Forwards stage ``stage`` runs before its first backward: ``min(2 (pp - 1 - stage) + 1, M)``."""
    return min(2 * (pp - 1 - stage) + 1, num_microbatches)


def paired_1f1b_order(pp: int, num_microbatches: int) -> dict[int, list[Any]]:
    """The compute order of every pp rank (rank ``s`` holds stage ``s``): warm-up forwards, ``OVERLAP_F_B`` pairs,
    cool-down backwards (module docstring). Deterministic: every rank builds the same."""
    order: dict[int, list[Any]] = {}
    for stage in range(pp):
        w = warmup(pp, stage, num_microbatches)
        actions = [torch_compat.pipeline_action(stage, "F", j) for j in range(w)]
        for k in range(num_microbatches - w):
            forward = torch_compat.pipeline_action(stage, "F", w + k)
            backward = torch_compat.pipeline_action(stage, "B", k)
            actions.append(torch_compat.pipeline_action(-1, "OVERLAP_F_B", None, (forward, backward)))
        actions += [torch_compat.pipeline_action(stage, "B", k) for k in range(num_microbatches - w, num_microbatches)]
        order[stage] = actions
    return order


def pairs_per_stage(pp: int, num_microbatches: int) -> list[int]:
    """``OVERLAP_F_B`` actions of each stage: ``M - w(s)``."""
    return [num_microbatches - warmup(pp, s, num_microbatches) for s in range(pp)]


__all__ = ["paired_1f1b_order", "pairs_per_stage", "warmup"]
