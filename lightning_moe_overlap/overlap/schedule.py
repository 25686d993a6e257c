"""The micro-batch schedule of one optimizer step, as a short list of named phases.

With overlap, the forward of micro-batch ``i+1`` and the backward of micro-batch ``i`` form one phase and run as
two execution contexts that pass a baton at every comm point (DualPipe's ``F|B`` pair)::

    F0, (F1|B0), (F2|B1), ..., (F[M-1]|B[M-2]), B[M-1]

Without overlap the phases are the plain sequential order, the oracle the overlapped run must match bitwise::

    F0, B0, F1, B1, ..., F[M-1], B[M-1]

Both orders run every micro-batch's forward before its backward and the backwards in micro-batch order, so
gradients accumulate in the same order.

That is the pp=1 instance of the engine's unit, a pair of *any* forward task with *any* backward task. A task
knows its micro-batch and its chunk (the pipeline stage it runs; 0 without pipeline parallelism): a pipeline
schedule's ``OVERLAP_F_B`` action pairs, e.g., the forward of micro-batch 7 on stage 0 with the backward of
micro-batch 3 on stage 2 (:func:`pair`, ``lightning_moe_overlap/pipeline/``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Role(str, Enum):
    """The two execution contexts of a phase."""

    FORWARD = "forward"
    BACKWARD = "backward"

    @property
    def partner(self) -> Role:
        return Role.BACKWARD if self is Role.FORWARD else Role.FORWARD

    @property
    def letter(self) -> str:
        return "F" if self is Role.FORWARD else "B"


# Which context holds the baton first in an ``F|B`` pair. The backward: (1) it matches Megatron's per-layer order
# (combine-backward all-to-all first, the forward's pre-dispatch compute under it); (2) the backward's first
# segment (loss and head gradient up to the last layer's combine backward) is short, so an all-to-all is in flight
# early; (3) the backward hands over at least as often as the forward (balanced hand-overs, docs/overlap.md;
# recompute re-issues forward comm points), and starting it first shortens the tail it runs alone, with its
# all-to-alls exposed, after the forward finished; (4) it frees micro-batch ``i``'s activations while ``i+1`` allocates, which lowers the peak.
PAIR_STARTER = Role.BACKWARD


@dataclass(frozen=True)
class Task:
    """One forward or backward of one micro-batch on one chunk (pipeline stage; 0 without pipeline parallelism).

    Its name is ``F3`` / ``B3`` on chunk 0 (the pp=1 names) and, like a pipeline action, ``2F3`` on chunk 2.
    """

    role: Role
    microbatch: int
    chunk: int = 0

    @property
    def name(self) -> str:
        prefix = f"{self.chunk}" if self.chunk else ""
        return f"{prefix}{self.role.letter}{self.microbatch}"


@dataclass(frozen=True)
class Phase:
    """Tasks that run together: one task, or a forward and a backward that share the baton."""

    tasks: tuple[Task, ...]

    @property
    def name(self) -> str:
        return "|".join(task.name for task in self.tasks)

    @property
    def roles(self) -> tuple[Role, ...]:
        return tuple(task.role for task in self.tasks)

    @property
    def starter(self) -> Role:
        """The role that holds the baton when the phase starts."""
        return PAIR_STARTER if len(self.tasks) == 2 else self.tasks[0].role


def forward(i: int, chunk: int = 0) -> Task:
    return Task(Role.FORWARD, i, chunk)


def backward(i: int, chunk: int = 0) -> Task:
    return Task(Role.BACKWARD, i, chunk)


def pair(forward_task: Task, backward_task: Task) -> Phase:
    """The phase in which ``forward_task`` and ``backward_task`` share the baton: any forward with any backward.

    Raises:
        ValueError: the first task is not a forward or the second not a backward.
    """
    if forward_task.role is not Role.FORWARD or backward_task.role is not Role.BACKWARD:
        raise ValueError(
            f"A pair is one forward task and one backward task, got ({forward_task.name}, {backward_task.name}). "
            "Pass the forward first and the backward second."
        )
    return Phase((forward_task, backward_task))


def build_schedule(num_microbatches: int, *, overlap: bool) -> tuple[Phase, ...]:
    """The phases of one step with ``num_microbatches`` micro-batches.

    Args:
        num_microbatches: ``M >= 1``.
        overlap: pair ``F[i+1]`` with ``B[i]``; otherwise run ``F0, B0, F1, B1, ...``.

    Raises:
        TypeError: ``num_microbatches`` is not an int.
        ValueError: ``num_microbatches < 1``.
    """
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int):
        raise TypeError(
            f"`num_microbatches` must be an int, got {type(num_microbatches).__name__} ({num_microbatches!r})."
        )
    if num_microbatches < 1:
        raise ValueError(
            f"`num_microbatches` must be >= 1, got {num_microbatches}: a step runs at least one micro-batch."
        )
    last = num_microbatches - 1
    if not overlap:
        return tuple(Phase((task(i),)) for i in range(num_microbatches) for task in (forward, backward))
    warmup = Phase((forward(0),))
    steady = tuple(pair(forward(i + 1), backward(i)) for i in range(last))
    cooldown = Phase((backward(last),))
    return (warmup, *steady, cooldown)
