"""The dispatcher contract shared by every backend.

A dispatcher moves routed tokens to the ranks that own their experts and brings the expert outputs back::

    x_RD, splits, handle = dispatcher.dispatch(x_TD, indices_TK, weights_TK)
    y_RD = experts(x_RD, splits)                              # rows sorted by local expert (*)
    out_TD = dispatcher.combine(y_RD, handle)

``splits`` is always a :class:`~lightning_moe_overlap.moe.grouped.RowSplits` (the rows of each local expert), on
every device and from every backend, which the grouped kernels read as it is. (*) From the all-to-all dispatcher
on CPU with more than one rank, the rows come in segments of one local expert each (``RowSplits.from_segments``).

Balanced hand-overs: some forward comm points of a dispatch have no backward twin (metadata exchanges). The
experts call :meth:`DispatcherBase.balance_backward` on their hidden rows once per call, whose backward hands over
that many extra times, so that forward and backward hand over equally often per layer (``docs/overlap.md``). How
many is the dispatcher's own business (``backward_handoffs``).

Inside, each direction runs in stages, and only the middle one communicates::

    dispatch: preprocess (no comm) -> token dispatch (comm) -> postprocess (no comm)
    combine:  preprocess (no comm) -> token combine (comm)  -> postprocess (no comm)

Everything one call needs later (splits, permutations, routing weights) travels in the frozen ``handle``
returned by ``dispatch`` and consumed by ``combine``, never on ``self``: with overlap, two micro-batches are in
flight on the same dispatcher at once.

Experts are split in contiguous blocks: ep rank ``r`` owns global experts ``[r * E / ep, (r + 1) * E / ep)``.
Indices outside ``[0, E)`` mark dropped (token, choice) pairs; they are not sent and contribute zero.

Shape legend:
    T: tokens on this rank    K: top-k    D: hidden size    R: rows received here, sorted by local expert (*)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_moe_overlap._checks import divisors, is_positive_int
from lightning_moe_overlap.overlap.backward_handoff import backward_handoff
from lightning_moe_overlap.overlap.communicator import group_rank, group_size
from lightning_moe_overlap.overlap.runtime import CommRuntime

if TYPE_CHECKING:  # grouped.py imports this package: a runtime import would be circular
    from lightning_moe_overlap.moe.grouped import RowSplits


@runtime_checkable
class TokenDispatcher(Protocol):
    """What :class:`~lightning_moe_overlap.moe.ep.ExpertParallelExperts` needs from a dispatcher."""

    num_experts: int
    num_local_experts: int
    first_expert: int
    runtime: CommRuntime | None

    def dispatch(self, x_TD: Tensor, indices_TK: Tensor, weights_TK: Tensor) -> tuple[Tensor, RowSplits, Any]: ...

    def combine(self, y_RD: Tensor, handle: Any) -> Tensor: ...

    def balance_backward(self, h: Tensor) -> Tensor: ...


def splits_evenly(num_experts: int, ep: int) -> bool:
    """The experts-per-ep rule: every ep rank owns the same number of experts (``num_experts % ep == 0``).

    The one statement of it: :func:`check_expert_split`, :class:`DispatcherBase` and the strategy's model check
    (``validation.check_model``) all ask here.
    """
    return num_experts % ep == 0


def check_expert_split(num_experts: int, ep: int, *, owner: str) -> None:
    """Raise ``ValueError`` unless ``ep`` divides ``num_experts`` (every rank must own as many experts).

    The boundary check of :func:`build_dispatcher` and :func:`apply_expert_parallel` (the strategy checks the
    model by the same rule in ``validation.check_model``); the dispatcher classes only assert it.
    """
    if not is_positive_int(num_experts):
        raise ValueError(f"{owner}: num_experts={num_experts!r} must be a positive integer.")
    if not splits_evenly(num_experts, ep):
        raise ValueError(
            f"{owner}: num_experts={num_experts} is not divisible by ep={ep}; each expert-parallel rank must own "
            f"the same number of experts (num_experts % ep == 0). Choose ep among {divisors(num_experts)}."
        )


class DispatcherBase:
    """Group bookkeeping common to all dispatchers (no per-call state).

    Args:
        ep_group: the expert-parallel process group; ``None`` for a single process (``ep=1``).
        num_experts: global number of experts ``E`` (divisible by the group size).
        runtime: comm-point hand-over target; ``None`` runs without any overlap engine.
    """

    name = "base"
    knobs: tuple[str, ...] = ()  # keyword arguments of this backend that `build_dispatcher` passes on
    # Forward comm points of one dispatch + combine that have no backward twin (metadata exchanges): the backward
    # of `balance_backward` hands over this many extra times, so that forward and backward hand over equally often.
    backward_handoffs = 0
    # Whether `dispatch` takes `fp8=recipe` and sends the rows in FP8 for FP8 experts (the all-to-all dispatcher);
    # the others send them in high precision whatever the experts run (docs/fp8.md, "FP8 dispatch").
    fp8_dispatch = False

    def __init__(self, ep_group: ProcessGroup | None, num_experts: int, runtime: CommRuntime | None) -> None:
        self.ep_group = ep_group
        self.ep_size = group_size(ep_group)
        self.ep_rank = group_rank(ep_group)
        if not is_positive_int(num_experts) or not splits_evenly(num_experts, self.ep_size):  # `check_expert_split`
            raise RuntimeError(
                f"`{type(self).__name__}`: num_experts={num_experts!r} cannot split over ep={self.ep_size}; build "
                "dispatchers with `build_dispatcher`, which checks the sizes."
            )
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size
        self.first_expert = self.ep_rank * self.num_local_experts
        self.runtime = runtime

    def balance_backward(self, h: Tensor) -> Tensor:
        """``h`` unchanged, whose backward hands over :attr:`backward_handoffs` times (nothing in flight).

        The experts call it once per call on their hidden rows, between the two projections, so that their backward
        stands in for this dispatcher's forward comm points that have no backward twin (the hand-over rule stays
        here: experts do not need to know how many).
        """
        return backward_handoff(h, self.runtime, self.backward_handoffs)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(ep={self.ep_size}, ep_rank={self.ep_rank}, num_experts={self.num_experts}, "
            f"local=[{self.first_expert}, {self.first_expert + self.num_local_experts}))"
        )
