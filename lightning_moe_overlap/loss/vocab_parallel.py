"""The LM head's loss at ``tp > 1``, where the head is vocabulary-parallel (a ``DTensor`` whose rows are split over
``mesh["tp"]``, docs/tensor_parallel.md) and its logits stay vocabulary-sharded.

- Unfused: the logits are a ``Shard(-1)`` ``DTensor`` and ``F.cross_entropy`` runs over the shards under torch's
  :func:`~torch.distributed.tensor.parallel.loss_parallel` (entered by the strategy around each step's forwards and
  backwards); the loss it returns is a replicated ``DTensor``, which :func:`plain_loss` turns into the plain scalar
  Lightning logs and back-propagates.
- Fused: :func:`head_cross_entropy` gathers the sequence-parallel hidden states over tp (autograd-aware), takes the
  rank's rows of the head (``to_local``) and calls :func:`fused_linear_cross_entropy` with ``group=`` the tp group.

Shape legend: B batch, S sequence, D hidden, V vocabulary (whole), T tokens.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import loss_parallel

from lightning_moe_overlap._compat import torch as torch_compat
from lightning_moe_overlap.loss.fused import DEFAULT_CHUNK_SIZE, Reduction, fused_linear_cross_entropy


def plain_loss(loss: Tensor) -> Tensor:
    """``loss`` as a plain tensor: a ``DTensor`` (the loss-parallel cross-entropy's replicated result) becomes its
    full value, through autograd; a plain tensor is returned as it is."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


@contextmanager
def loss_parallel_scope() -> Iterator[None]:
    """torch's :func:`~torch.distributed.tensor.parallel.loss_parallel`, left even when the body raises (torch's
    context manager removes its handlers only on a normal exit, and they are process-wide: a failed step would
    leave them installed for the rest of the process)."""
    scope = loss_parallel()
    scope.__enter__()
    try:
        yield
    finally:
        scope.__exit__(None, None, None)  # resumes torch's generator after its `yield`: the handlers are removed


def check_loss_parallel(tensor: Tensor, what: str, where: str) -> None:
    """``RuntimeError`` when ``tensor`` (the logits, or the head's weight) is a ``DTensor`` and the cross-entropy of
    the vocabulary-sharded logits is about to run outside torch's ``loss_parallel`` (where ``DTensor`` refuses the
    plain targets with "got mixed torch.Tensor and DTensor")."""
    if isinstance(tensor, DTensor) and not torch_compat.loss_parallel_enabled():
        raise RuntimeError(
            f"`{where}`: {what} is a DTensor {list(tensor.shape)} with placements {tuple(tensor.placements)} (the "
            "vocabulary-parallel head at tp > 1) and torch's `loss_parallel` is not entered. Rule: the "
            "cross-entropy of vocabulary-sharded logits runs over the shards under `loss_parallel`, forward and "
            "backward (MoEOverlapStrategy enters it around each step). Fix: run the step under the strategy, or "
            "wrap the forward and the backward in `torch.distributed.tensor.parallel.loss_parallel()`."
        )


def plain_step_output(output: Any) -> Any:
    """A ``training_step``'s output with a ``DTensor`` loss (a user's cross-entropy over the vocabulary-sharded
    logits, at ``tp > 1``) made plain: the loss itself, or a mapping's ``"loss"``; anything else as it is."""
    if isinstance(output, DTensor):
        return plain_loss(output)
    if isinstance(output, Mapping) and isinstance(output.get("loss"), DTensor):
        return {**output, "loss": plain_loss(output["loss"])}
    return output


def plain_logits(logits: Tensor) -> Tensor:
    """The whole logits of a vocabulary-sharded ``DTensor`` (gathered: for predictions, not for the loss)."""
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


def head_cross_entropy(
    hidden_BSD: Tensor,
    weight_VD: Tensor,
    target_BS: Tensor,
    *,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    where: str = "fused cross-entropy",
) -> Tensor:
    """:func:`fused_linear_cross_entropy` of the head ``weight_VD`` (and ``bias``), plain or vocabulary-parallel.

    With a plain weight it is that function. With a ``DTensor`` weight sharded by rows over a one-dimensional mesh
    (the tensor-parallel plans' head), the rank's rows (``to_local``) and ``group=`` the mesh's group; ``hidden_BSD``
    is the head's input as the plan lays it out: the rank's ``S / tp`` positions of the sequence (a plain tensor,
    sequence parallelism; gathered over tp here, its gradient split back) or already the whole sequence (``S``
    positions, or a ``DTensor``, made whole). ``target_BS`` covers the whole sequence on every tp rank.

    Raises:
        NotImplementedError: a ``DTensor`` head this function does not split (another mesh or placement, a
            vocabulary tp does not divide), naming the fix.
    """
    if not isinstance(weight_VD, DTensor):
        return fused_linear_cross_entropy(
            hidden_BSD, weight_VD, target_BS, bias=bias, ignore_index=ignore_index, reduction=reduction,
            chunk_size=chunk_size,
        )
    vocab_dim = check_vocab_parallel_head(weight_VD, bias, where)
    mesh = weight_VD.device_mesh
    whole_BSD = _whole_sequence(hidden_BSD, target_BS, mesh, vocab_dim, where)
    local_bias = bias.to_local() if isinstance(bias, DTensor) else bias
    return fused_linear_cross_entropy(
        whole_BSD, weight_VD.to_local(), target_BS, bias=local_bias, ignore_index=ignore_index,
        reduction=reduction, chunk_size=chunk_size, group=mesh.get_group(vocab_dim),
    )


def check_vocab_parallel_head(weight: DTensor, bias: Tensor | None, where: str) -> int:
    """The mesh dimension ``weight``'s rows are split over, evenly (the vocabulary-parallel head); every other mesh
    dimension holds it whole (``Replicate``, or of size 1: a data-parallel replica's wrapping, as ``fully_shard``
    over a size-1 shard dimension leaves it).

    Raises:
        NotImplementedError: any other layout (of the weight, or of a ``DTensor`` bias), naming the fix."""
    mesh, placements = weight.device_mesh, tuple(weight.placements)
    split = [i for i, p in enumerate(placements) if mesh.size(i) > 1 and not p.is_replicate()]
    vocab_dim = split[0] if len(split) == 1 and type(placements[split[0]]) is Shard else None
    tp = 1 if vocab_dim is None else mesh.size(vocab_dim)
    even = vocab_dim is not None and placements[vocab_dim].dim == 0 and weight.shape[0] % tp == 0
    bias_ok = not isinstance(bias, DTensor) or bias.to_local().shape[0] * tp == bias.shape[0]
    if vocab_dim is None or not even or weight.to_local().shape[0] * tp != weight.shape[0] or not bias_ok:
        raise NotImplementedError(
            f"`{where}`: the LM head's weight is a DTensor {list(weight.shape)} with placements {placements} on a "
            f"mesh of shape {tuple(mesh.shape)}. Rule: the fused cross-entropy takes a vocabulary-parallel head "
            "split by rows (Shard(0)) over one mesh dimension, into equal parts (tp divides the vocabulary), and "
            "whole on the others. Fix: plan the head with `ColwiseParallel` over the tp mesh and pad the vocabulary "
            "to a multiple of tp, or `fused_cross_entropy=False`."
        )
    return vocab_dim


def _whole_sequence(hidden_BSD: Tensor, target_BS: Tensor, mesh: DeviceMesh, vocab_dim: int, where: str) -> Tensor:
    """The head's input over the whole sequence: a ``DTensor`` made ``Replicate``; the rank's sequence shard of a
    plain tensor gathered over the mesh dimension ``vocab_dim`` (the tp ranks; the backward keeps the rank's part of
    the full gradient); a plain tensor of the whole sequence as it is."""
    if isinstance(hidden_BSD, DTensor):
        return hidden_BSD.redistribute(hidden_BSD.device_mesh, [Replicate()] * hidden_BSD.device_mesh.ndim).to_local()
    tp = mesh.size(vocab_dim)
    if hidden_BSD.shape[:-1] == target_BS.shape:
        return hidden_BSD  # already the whole sequence (a plan without sequence parallelism before the head)
    if hidden_BSD.dim() == 3 and hidden_BSD.shape[1] * tp == target_BS.shape[-1]:
        placements = [Shard(1) if i == vocab_dim else Replicate() for i in range(mesh.ndim)]
        shard = DTensor.from_local(hidden_BSD, mesh, placements, run_check=False)
        return shard.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()
    raise ValueError(
        f"`{where}`: hidden states {list(hidden_BSD.shape)} for targets {list(target_BS.shape)} at tp={tp}. Rule: "
        "the head's input holds the whole sequence or this rank's S / tp positions of it ([B, S / tp, D]). Fix: "
        "pass the final norm's output as the tensor-parallel plan lays it out, and the whole sequence's targets."
    )
