"""Dense parameters on torch's FSDP2 (``fully_shard``), composed with the overlap engine.

Why every parameter is a ``DTensor``. The experts are ``DTensor``s over the ep mesh (``moe/ep.py``), and torch's
optimizers refuse a parameter group that mixes ``DTensor``s and plain tensors (their ``foreach`` kernels), so the
dense parameters must be ``DTensor``s too; ``fully_shard`` makes them so, and swaps the gathered tensors in for the
forward and backward. Mode ``"none"`` shards nothing: the dense parameters are replicated over ``dp x cp`` through
``fully_shard`` on a 2-D ``(dp_cp, 1)`` mesh (hybrid sharding whose shard dimension has one rank: their gradients
are all-reduced), and the experts, which ``fully_shard`` ignores here, keep their ``edp`` all-reduce
(``grads.py``).

The step, and why it is safe with the overlap engine. The engine runs the forward of one micro-batch and the
backward of another on two threads through the same modules, so no all-gather, reduce-scatter or reshard may run
inside a pair. :meth:`ShardedModel.begin_step` therefore turns gradient sync and resharding off and gathers the
parameters once, on the calling thread, before the first forward; FSDP's hooks then find them gathered and only
accumulate gradients. :meth:`ShardedModel.end_step`, after the last backward, runs the reduction FSDP deferred and
reshards, as torch's pipelining does after its last backward.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from lightning_moe_overlap._compat import torch as torch_compat
from lightning_moe_overlap.parallel.dims import ParallelDims


def replicate_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The 2-D ``(dp_cp, unit)`` mesh of this rank's ``dp x cp`` group with a size-1 shard dimension. Collective."""
    root = init_device_mesh(
        device_type,
        (dims.pp, dims.dp * dims.cp, dims.tp, 1),
        mesh_dim_names=("pp", "dp_cp", "tp", "unit"),
    )  # the rank layout of ParallelDims: (pp, [dp x cp], tp), tp fastest
    return root["dp_cp", "unit"]


class ShardedModel:
    """The modules ``fully_shard`` was applied to (``roots``: the model at ``pp = 1``, each held chunk at
    ``pp > 1``) and the per-step calls that keep FSDP's communication out of the overlapped pairs."""

    def __init__(self, roots: Sequence[FSDPModule], mode: str = "none") -> None:
        self.roots = list(roots)
        self.mode = mode

    @classmethod
    def replicate(cls, roots: Sequence[nn.Module], ignored: Iterable[nn.Parameter], mesh: DeviceMesh) -> ShardedModel:
        """``fully_shard`` each of ``roots`` over the 2-D replicate ``mesh`` (:func:`replicate_mesh`), leaving the
        ``ignored`` parameters (the experts) alone."""
        ignored_ids = {id(p) for p in ignored}
        for root in roots:
            mine = {p for p in root.parameters() if id(p) in ignored_ids}
            fully_shard(root, mesh=mesh, reshard_after_forward=False, ignored_params=mine)
        return cls([root for root in roots if isinstance(root, FSDPModule)], mode="none")

    def modules(self) -> list[FSDPModule]:
        """Every module under the roots that ``fully_shard`` was applied to (each gathers its own parameters)."""
        return [m for root in self.roots for m in root.modules() if isinstance(m, FSDPModule)]

    def begin_step(self) -> None:
        """Before the first micro-batch: sync and resharding off, the parameters gathered once (here, on this thread).

        A gathered copy left by an earlier forward (validation) is dropped first: it may predate the last
        optimizer step or a checkpoint load."""
        for root in self.roots:
            torch_compat.fsdp_lazy_init(root)
            root.set_is_last_backward(False)
            root.set_requires_gradient_sync(False)
            root.set_reshard_after_backward(False)
        for module in self.modules():
            module.reshard()
            module.unshard()

    def end_step(self) -> None:
        """After the last micro-batch's backward: reduce the accumulated gradients and reshard."""
        for root in self.roots:
            root.set_is_last_backward(True)
            root.set_requires_gradient_sync(True)
            root.set_reshard_after_backward(True)
            torch_compat.fsdp_reduce_gradients(root)

    def gather(self) -> None:
        """Gather every parameter (collective over the shard groups; nothing for those already gathered): the
        model's submodules can then be called directly, their parameters being plain tensors once gathered."""
        for module in self.modules():
            module.unshard()

    def release(self) -> None:
        """After a checkpoint's ``state_dict()`` (which reshards) and at the end of a run, in mode ``"none"``: leave
        the parameters gathered, so that the model can be called as before. Gathering over a size-1 shard
        dimension communicates with no other rank, so this is safe in a teardown after another rank failed."""
        if self.mode == "none":
            self.gather()
