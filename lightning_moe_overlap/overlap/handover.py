"""The hand-over of the phase that runs now: the one piece of per-phase state the model's comm points read.

The engine binds each phase's :class:`~lightning_moe_overlap.overlap.baton.Baton` for the phase's duration
(:meth:`PhaseHandOff.bound`); every comm point of the model hands over through it, whatever thread runs it.

It is a field of the comm runtime, not a context variable: on CUDA the backward comm points run on autograd's
device thread, which inherits no context from the lane that called ``backward()`` (seen on an H200, ``tests/gpu``),
so a context variable set by the lane would not be seen there. One phase runs at a time per runtime, so one field
is enough; binding a second phase while one is bound is an error.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from lightning_moe_overlap.overlap.schedule import Role


class HandOff(Protocol):
    """What the engine binds while a phase runs (``baton.py``'s ``Baton`` is one)."""

    def handoff(self) -> None: ...

    @property
    def holder(self) -> Role: ...


class PhaseHandOff:
    """The bound phase's hand-over, or nothing between phases (then a comm point does not hand over)."""

    __slots__ = ("_bound",)

    def __init__(self) -> None:
        self._bound: HandOff | None = None

    @property
    def bound_handoff(self) -> HandOff | None:
        """The bound phase's hand-over; ``None`` outside a phase."""
        return self._bound

    @contextmanager
    def bound(self, handoff: HandOff) -> Iterator[None]:
        """Route the comm points' hand-overs to ``handoff`` for the duration of one phase."""
        if self._bound is not None:
            raise RuntimeError(
                "`CommRuntime.phase.bound`: a schedule is already active on this runtime (a phase is bound); one "
                "runtime runs one phase at a time. Run the schedules one after the other, or give each its own "
                "runtime."
            )
        self._bound = handoff
        try:
            yield
        finally:
            self._bound = None
