"""What this rank holds of the parallelised model, by the unsplit model's names: what a checkpoint loader fills.

After ``MoEOverlapStrategy.setup`` (``parallelize/steps.py``), a rank holds, per parameter and persistent buffer:

- a plain tensor (a dense tensor at ``pp = 1`` without ``fully_shard``, a buffer), or
- a ``DTensor``: the experts ``Shard(0)`` over the ep mesh (global shape ``[E, ...]``), a dense parameter under
  ``fully_shard`` (a replica or a shard over dp x cp), experts sharded over edp too;
- at ``pp > 1``, only its own chunks' tensors; the other pp ranks' are on the meta device.

:func:`held_tensors` maps each unsplit name to the tensor object this rank holds (write into its local shard in
place, under ``torch.no_grad()``); :func:`global_shapes` maps every unsplit name of the whole model, held or not, to
its global shape. A loader reads, for each held name, the part of the checkpoint tensor its local shard covers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor, nn

if TYPE_CHECKING:
    from lightning_moe_overlap.pipeline.pipelined import PipelinedModel


def held_tensors(model: nn.Module, pipeline: PipelinedModel | None = None) -> dict[str, Tensor]:
    """``{unsplit name: tensor}`` for every parameter and persistent buffer of ``model`` this rank holds (plain or
    ``DTensor``, never a meta tensor), in the unsplit model's ``state_dict`` order.

    At ``pp > 1`` pass the rank's :class:`PipelinedModel` (the strategy's): its held chunks' tensors come under their
    unsplit names through the split's name map, plus the model's tensors outside every chunk.
    """
    state = model.state_dict(keep_vars=True)
    if pipeline is None:
        return {k: v for k, v in state.items() if isinstance(v, Tensor) and not v.is_meta}
    split = pipeline.split
    out: dict[str, Tensor] = {}
    for c in pipeline.held:
        chunk_state = split.chunks[c].state_dict(keep_vars=True)
        for key, fqn in split.name_map(c).items():
            out[fqn] = chunk_state[key]
    in_chunks = {fqn for c in range(len(split.chunks)) for fqn in split.name_map(c).values()}
    out.update({k: v for k, v in state.items() if k not in in_chunks and isinstance(v, Tensor) and not v.is_meta})
    return {k: out[k] for k in state if k in out}  # the unsplit model's order


def global_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """``{unsplit name: global shape}`` for every parameter and persistent buffer of the whole model, held here or
    not (a ``DTensor``'s global shape; the meta tensors of other pp ranks' chunks keep theirs, their experts
    ``[E, ...]``)."""
    return {k: tuple(v.shape) for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, Tensor)}
