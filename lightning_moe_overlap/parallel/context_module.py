"""What a LightningModule sees of context parallelism: ``module.context_parallel``, set by the strategy at cp > 1.

The strategy cannot shard a batch itself: only the model knows which tensors of a micro-batch are sequences and how
it shifts its targets (the targets must be shifted on the whole sequence, before sharding). So a LightningModule
that runs at ``cp > 1`` declares the attribute ``context_parallel`` (``None`` by default: ``MoEGPT`` does), and the
strategy sets it to a :class:`ContextParallel` (``parallelize/steps.py``, ``apply_cp``). In its loss the module then
shards its per-token tensors with :meth:`ContextParallel.shard` and computes the mean loss over the tokens it kept::

    inputs_BT, targets_BT = tokens_BS[:, :-1], tokens_BS[:, 1:]      # shifted on the whole sequence
    if self.context_parallel is not None:
        (inputs_BT, targets_BT), position_ids = self.context_parallel.shard(inputs_BT, targets_BT)

Each cp rank keeps ``T / cp`` tokens of every sequence (head-tail chunks, ``context_batch.py``); the strategy runs
the attention of the module's forwards as torch's ring over the cp group (``context_attention.py``; entered on the
thread of each forward, the engine's lanes included) and averages gradients over ``dp x cp``: with equal tokens on
every rank the mean of the cp ranks' losses is the loss of the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_moe_overlap.parallel.context_attention import ContextParallelAttention
from lightning_moe_overlap.parallel.context_batch import check_sequence, shard_batch
from lightning_moe_overlap._checks import same_on_every_rank

ATTR = "context_parallel"  # the LightningModule's attribute the strategy sets


@dataclass(frozen=True)
class ContextParallel:
    """This rank's place in the cp group and the ring attention over it.

    Attributes:
        size: ``cp``, the ranks that share each sequence.
        rank: this rank's index in the cp group.
        attention: torch's ring attention over the cp mesh (head-tail shards, causal attention).
        tp: the tensor-parallel size: with sequence parallelism each cp rank's part of a sequence is split again
            over tp between the attention blocks (a router sees ``T / (cp x tp)`` tokens).
        sequence_group: the ``cp x tp`` ranks that hold the parts of each sequence (``ParallelGroups.cp_tp``; None:
            the cp group), over which per-token statistics are summed.
    """

    size: int
    rank: int
    attention: ContextParallelAttention
    tp: int = 1
    sequence_group: ProcessGroup | None = None

    def shard(
        self, *tensors_BT: Tensor | None, position_ids: Tensor | None = None, seq_dim: int = 1
    ) -> tuple[tuple[Tensor | None, ...], Tensor]:
        """This rank's tokens of a micro-batch's per-token tensors (``None`` passes through), and their global
        position ids (``(1, S)``, or ``position_ids`` sharded alike). Shift targets before calling it.

        Raises:
            ValueError: the sequence length is not a multiple of ``2 * cp`` (rule ``cp-divides-sequence``); the
                message names the length, cp and the nearest length that fits.
        """
        lengths = {t.size(seq_dim) for t in tensors_BT if t is not None}
        for length in sorted(lengths):
            try:
                check_sequence(length, self.size)
            except ValueError as err:
                raise same_on_every_rank(ValueError(
                    f"`MoEOverlapStrategy(cp={self.size})` (rule `cp-divides-sequence`, docs/validation.md): {err}"
                )) from None
        return shard_batch(self.size, self.rank, *tensors_BT, position_ids=position_ids, seq_dim=seq_dim)
