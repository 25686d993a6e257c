"""The static layout of the all-to-all dispatcher (``static=True``): fixed slots, sizes never read on the host.

An uneven ``all_to_all_single`` takes its split sizes as Python ints, so the plain dispatch reads the exchanged
counts back to the host once per layer and micro-batch (``host.py``). The static layout needs no such read: every
rank sends every rank the same number of rows, ``C`` slots for each of that rank's experts, and the counts that
say how many slots hold a row travel on the device only (Megatron's ``moe_pad_expert_input_to_capacity``, DeepEP's
``num_worst_tokens``).

Slot capacity ``C`` (:func:`slot_capacity`): ``ceil(T * K / E * capacity_factor)`` with a capacity factor, the
capacity the experts already drop to, so no row is lost here; ``T`` dropless (a token chooses an expert at most
once, so no expert receives more than ``T`` rows from one rank). Rows beyond ``C`` are dropped by position
(:func:`plan_slots`) and counted, never silently: that only happens when the slot factor is smaller than the
experts' own.

Layouts::

    source:  send_SD  [E * C, D]   slot e * C + p holds the p-th row for global expert e (rank-major, as E is)
    wire:    recv_SD  [G * e * C]  from each source rank, its slots for this rank's e experts
    experts: x_RD     [e * G * C]  the rows that hold a token, by local expert then source rank (the plain
                                   dispatch's CUDA layout), then every empty slot: a tail the grouped GEMM skips

The experts get a :class:`~lightning_moe_overlap.moe.grouped.RowSplits` of device counts with a padded tail, so
``torch._grouped_mm`` reads its offsets on the device. Every rank must hold the same number of tokens per
micro-batch (the slot capacity derives from it): the count exchange carries ``T`` and a rank that sees another
``T`` stops with an error (``torch._assert_async``, through ``_compat/torch.py``: no host read on CUDA).

Shape legend:
    T: tokens on this rank   K: top-k   D: hidden size   E: experts   e: local experts   G: ep ranks
    C: slots per (rank, expert)   A: assignments ``T * K``   S: slots sent ``E * C``   R: rows for the experts
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_moe_overlap.moe.capacity import expert_capacity
from lightning_moe_overlap.moe.permute import count_per_expert, expert_key, gather_rows


def slot_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float | None) -> int:
    """Slots per (source rank, expert): the experts' capacity, or ``num_tokens`` dropless (at least 1 when there
    are tokens; never more than ``num_tokens``, which no expert can exceed)."""
    if capacity_factor is None or num_tokens == 0:
        return num_tokens
    return max(1, min(num_tokens, expert_capacity(num_tokens, top_k, num_experts, capacity_factor)))


@dataclass(frozen=True)
class SlotPlan:
    """Where this rank's assignments go (source side; all on the device).

    Attributes:
        order_A: every assignment id (``token * K + choice``), sorted by expert, dropped ones last.
        slot_A: the slot of each, in ``order_A``'s order; ``E * C`` (one past the last) for one not sent.
        kept_A: whether each was sent.
        sent_E: rows sent to each expert (at most ``C``).
        over_E: rows over ``C`` per expert, dropped here.
    """

    order_A: Tensor
    slot_A: Tensor
    kept_A: Tensor
    sent_E: Tensor
    over_E: Tensor


def plan_slots(indices_TK: Tensor, num_experts: int, capacity: int) -> SlotPlan:
    """Sort the assignments by expert and give each its slot: the ``p``-th row of expert ``x`` (token order) goes
    to slot ``x * capacity + p``; rows with ``p >= capacity`` and dropped choices (outside ``[0, E)``) to none."""
    key_A = expert_key(indices_TK, num_experts)
    order_A = torch.argsort(key_A, stable=True)
    counts = count_per_expert(key_A, num_experts + 1)  # the last bin: dropped choices
    starts = torch.cumsum(counts, 0) - counts
    sorted_key = key_A.index_select(0, order_A)
    pos_A = torch.arange(key_A.numel(), device=key_A.device) - starts.index_select(0, sorted_key)
    kept_A = (sorted_key < num_experts) & (pos_A < capacity)
    slot_A = torch.where(kept_A, sorted_key * capacity + pos_A, num_experts * capacity)
    routed_E = counts[:num_experts]
    sent_E = routed_E.clamp(max=capacity)
    return SlotPlan(order_A, slot_A, kept_A, sent_E, routed_E - sent_E)


def fill_slots(x_TD: Tensor, plan: SlotPlan, top_k: int, num_slots: int) -> Tensor:
    """The send buffer ``[num_slots, D]``: each sent row in its slot, zeros in the empty ones (differentiable:
    the backward reads each row's gradient back from its slot)."""
    x_AD = gather_rows(x_TD, plan.order_A, top_k)
    buffer = x_AD.new_zeros(num_slots + 1, x_AD.shape[-1])  # one past the end takes what is not sent
    return buffer.index_copy_(0, plan.slot_A, x_AD)[:num_slots]  # in place: a fresh buffer, no second copy


def read_slots(y_SD: Tensor, plan: SlotPlan) -> Tensor:
    """Each assignment's returned row, in ``plan.order_A``'s order; zeros for one not sent (whatever its slot
    held: empty slots carry rows the experts never wrote)."""
    last = max(y_SD.shape[0] - 1, 0)
    rows = (
        y_SD.index_select(0, plan.slot_A.clamp(max=last))
        if y_SD.shape[0]
        else y_SD.new_zeros(plan.slot_A.shape[0], y_SD.shape[-1])
    )
    return torch.where(plan.kept_A.unsqueeze(-1), rows, 0.0)


@dataclass(frozen=True)
class SlotGrid:
    """The fixed part of :func:`expert_major` for one shape ``[G, e, C]`` (built once per capacity, kept by the
    dispatcher): each slot's index within its (source, expert), its expert, and the slot ids in ``[e, G, C]``
    order."""

    within_C: Tensor
    expert_EGC: Tensor
    slots_EGC: Tensor

    @classmethod
    def build(cls, ranks: int, local: int, capacity: int, device: torch.device) -> SlotGrid:
        expert = torch.arange(local, device=device).view(-1, 1, 1).expand(local, ranks, capacity)
        slots = torch.arange(ranks * local * capacity, device=device).view(ranks, local, capacity).transpose(0, 1)
        return cls(torch.arange(capacity, device=device), expert, slots.reshape(-1))


def expert_major(recv_GE: Tensor, grid: SlotGrid) -> Tensor:
    """The row order ``perm_R`` that takes the received slots ``[G, e, C]`` to the experts' layout: the rows that
    hold a token, by local expert, then source rank, then slot; then every empty slot (on the device)."""
    full_EGC = grid.within_C.view(1, 1, -1) < recv_GE.t().unsqueeze(-1)  # [e, G, C]
    key = torch.where(full_EGC, grid.expert_EGC, recv_GE.shape[1]).reshape(-1)
    return grid.slots_EGC.index_select(0, torch.argsort(key, stable=True))


@dataclass(frozen=True)
class SlotUsage:
    """What the static layout cost over the calls counted (:meth:`AllToAllDispatcher.static_usage`).

    Attributes:
        calls: dispatches counted (a recomputed forward dispatches again, and counts).
        rows: rows that carried a token (sent by this rank).
        slots: rows of the send buffers (``E * C`` per call); ``slots - rows`` were padding on the wire.
        dropped: rows over the slot capacity, dropped by the dispatcher (0 when the slots hold the experts'
            capacity, or dropless).
    """

    calls: int
    rows: int
    slots: int
    dropped: int

    @property
    def padding_share(self) -> float:
        """The share of the slots sent that carried no token: the bytes (and the receive buffer's rows) the fixed
        shape costs over the plain dispatch."""
        return 0.0 if self.slots == 0 else 1.0 - self.rows / self.slots
