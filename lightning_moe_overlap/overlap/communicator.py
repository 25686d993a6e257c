"""How the dispatchers' collectives are issued: one communicator object, injected through the comm runtime.

``comm.py`` (the comm points) asks the communicator of its runtime (``CommRuntime(communicator=...)``; without a
runtime, or with ``None``, :data:`TORCH`) to issue each collective and gets back a :class:`Waitable`. The
communicator also says whether an exchange over a group moves rows at all (:meth:`Communicator.exchanges`): with
one rank and ``torch.distributed`` nothing is issued, and the comm point only hands over.

- :class:`TorchCommunicator` (:data:`TORCH`): ``torch.distributed``'s asynchronous collectives, what training uses;
- ``loopback.py``'s ``Loopback``: a one-process stand-in for the other ranks of an ep group (the benchmark's
  simulated expert parallelism), whose all-to-alls are copies of known duration.

Shape legend:
    N: rows sent by this rank       M: rows received        D: feature size         G: ranks in the group
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_moe_overlap.overlap.observers import Waitable

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: ProcessGroup | None) -> int:
    """Ranks in ``group``; ``None`` means a single process (no communication)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank inside ``group``; 0 for ``None``."""
    return 0 if group is None else dist.get_rank(group)


class Communicator(Protocol):
    """Issues the collectives of the comm points (module docstring); every method returns at once."""

    def exchanges(self, group: ProcessGroup | None) -> bool:
        """Whether an all-to-all over ``group`` moves rows (else the comm point only hands over)."""
        ...

    def all_to_all(
        self, out_MD: Tensor, x_ND: Tensor, output_splits: Sequence[int], input_splits: Sequence[int],
        group: ProcessGroup | None,
    ) -> Waitable:
        """Issue an uneven all-to-all along dim 0 (``x_ND`` contiguous)."""
        ...

    def remote_rows(self, input_splits: Sequence[int], group: ProcessGroup | None) -> int:
        """Of the rows an all-to-all sends, those that leave this process."""
        ...

    def all_gather(self, out_GND: Tensor, x_ND: Tensor, group: ProcessGroup) -> Waitable:
        """Issue an equal-size all-gather along dim 0 over a group of two or more ranks."""
        ...

    def reduce_scatter(self, out_ND: Tensor, x_GND: Tensor, group: ProcessGroup) -> Waitable:
        """Issue a sum-reduce-scatter along dim 0 over a group of two or more ranks."""
        ...


class TorchCommunicator:
    """``torch.distributed``'s asynchronous collectives (``async_op=True``)."""

    def exchanges(self, group: ProcessGroup | None) -> bool:
        return group_size(group) > 1

    def all_to_all(
        self, out_MD: Tensor, x_ND: Tensor, output_splits: Sequence[int], input_splits: Sequence[int],
        group: ProcessGroup | None,
    ) -> Waitable:
        return dist.all_to_all_single(out_MD, x_ND, list(output_splits), list(input_splits), group=group, async_op=True)

    def remote_rows(self, input_splits: Sequence[int], group: ProcessGroup | None) -> int:
        return sum(input_splits) - input_splits[group_rank(group)]

    def all_gather(self, out_GND: Tensor, x_ND: Tensor, group: ProcessGroup) -> Waitable:
        return _all_gather_single(out_GND, x_ND, group=group, async_op=True)

    def reduce_scatter(self, out_ND: Tensor, x_GND: Tensor, group: ProcessGroup) -> Waitable:
        return _reduce_scatter_single(out_ND, x_GND, group=group, async_op=True)


TORCH = TorchCommunicator()
