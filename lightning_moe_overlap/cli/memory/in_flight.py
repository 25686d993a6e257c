"""How many micro-batches' activations a pp rank holds at its peak, from the schedule's own order of actions.

At ``pp = 1`` the overlap engine's schedule ``F0, (F1|B0), ..., B[M-1]`` runs two micro-batches at once, but the
backward of ``i`` takes the baton first at every hand-over (``overlap/schedule.py``, ``PAIR_STARTER``) and frees its
layers' activations as the forward of ``i+1`` allocates its own, one segment between two comm points at a time: the peak
is one micro-batch plus about half a layer (a layer has two comm points; measured on gloo,
``benchmarks/memory_check.py``), not two micro-batches. The sequential schedule ``F0, B0, F1, ...`` holds one. At
``pp > 1`` torch's schedule is built with stand-in stages of each pp rank (no process group; as
``pipeline/schedules.py``'s ``docs_orders``), interleaved 1F1B rewritten into overlapped pairs as the strategy does
(1F1B overlapped: its paired order, ``pipeline/paired_1f1b.py``), and its compute order walked: a
forward adds its chunk's micro-batch activations, a full or input-gradient backward frees them, a pair adds its
forward's before freeing its backward's. The peak of that walk is the rank's. (A pair is counted whole, its forward
before its backward frees: an upper bound. Zero bubble's split backward keeps the weight GEMMs' inputs until the weight
half: not counted.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def pp1_in_flight(num_microbatches: int, overlap: bool) -> int:
    """Micro-batches that run at once at ``pp = 1``: 2 with overlap (and ``M > 1``), else 1 (the peak of 2 is one
    micro-batch plus half a layer: module docstring)."""
    return 2 if overlap and num_microbatches > 1 else 1


def peak_bytes(actions: list[Any], chunk_bytes: Mapping[int, int]) -> tuple[int, dict[int, int]]:
    """The peak of the activations held while ``actions`` run, with ``chunk_bytes[stage]`` per micro-batch, and the
    micro-batches held per stage at that peak."""
    from lightning_moe_overlap._compat.torch import action_kind

    live: dict[int, int] = {}
    peak, at_peak = 0, {}

    def held() -> int:
        return sum(chunk_bytes.get(s, 0) * n for s, n in live.items())

    def step(action: Any, sign: int) -> None:
        live[action.stage_index] = live.get(action.stage_index, 0) + sign

    for action in actions:
        if action is None:
            continue
        kind = action_kind(action)
        if kind == "OVERLAP_F_B":
            forward, backward = action.sub_actions
            step(forward, +1)
            if held() > peak:
                peak, at_peak = held(), dict(live)
            step(backward, -1)
        elif kind == "F":
            step(action, +1)
            if held() > peak:
                peak, at_peak = held(), dict(live)
        elif kind in ("B", "I"):
            step(action, -1)
    return peak, at_peak
