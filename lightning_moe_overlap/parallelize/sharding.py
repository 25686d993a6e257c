"""Parameters on torch's FSDP2 (``fully_shard``), composed with the overlap engine; ``shard="none" | "optimizer" |
"full"`` (docs/sharding.md).

Why every parameter is a ``DTensor``. The experts are ``DTensor``s over the ep mesh (``moe/ep.py``), and torch's
optimizers refuse a parameter group that mixes ``DTensor``s and plain tensors (their ``foreach`` kernels), so the
dense parameters must be ``DTensor``s too; ``fully_shard`` makes them so, and swaps the gathered tensors in for the
forward and backward.

Modes:

- ``"none"`` shards nothing: the dense parameters are replicated over ``dp x cp`` through ``fully_shard`` on a 2-D
  ``(dp_cp, 1)`` mesh (hybrid sharding whose shard dimension has one rank: their gradients are all-reduced), and the
  experts, which ``fully_shard`` ignores here, keep their ``edp`` all-reduce (``parallel/grads.py``).
- ``"optimizer"`` (ZeRO-1-like) and ``"full"`` (ZeRO-3-like): the root over ``mesh["dp_cp"]`` (dense parameters
  ``Shard(0)`` over ``dp x cp``) and every expert-parallel experts module over ``mesh["edp"]`` (experts 2-D over
  ``(edp, ep)``); both reduce-scatters divide by ``dp * cp`` (an expert's local gradient already holds the tokens of
  its whole ep group: ``parallel/grads.py``, "Scaling"). The optimizer holds the shards, so its state is sharded. In
  ``"optimizer"`` the parameters are gathered again right after each optimizer step (full parameters at rest); in
  ``"full"`` they stay sharded until the next step's gather.

The step, and why it is safe with the overlap engine. The engine runs the forward of one micro-batch and the
backward of another on two threads through the same modules, so no all-gather, reduce-scatter or reshard may run
inside a pair. :meth:`ShardedModel.begin_step` therefore turns gradient sync and resharding off and gathers the
parameters once, on the calling thread, before the first forward; :meth:`ShardedModel.end_step`, after the last
backward, runs the reduction FSDP deferred (one reduce-scatter per module) and reshards, as torch's pipelining does
after its last backward. In the sharded modes FSDP's hooks are also kept idle in between (``_compat/torch.py``,
``fsdp_set_hooks_idle``): they keep one training state per module, which the two threads' hooks would otherwise
flip under each other (a forward ending while the other thread's backward set the state would reshard).

``overlap_grad_reduce`` (sharded modes): every element of a ``nn.ModuleList`` that holds an experts module (the
model's layers) becomes an FSDP unit of its own over ``dp_cp``, and :meth:`ShardedModel.before_last_backward` arms
an :class:`~lightning_moe_overlap.parallel.grad_reduce.EarlyReduction`: each unit is reduced as soon as its
gradients are final in the last backward, which runs alone, after every overlapped pair (``grad_reduce.py``); at
``pp > 1`` each held chunk is armed before its own last backward.

At ``pp > 1`` the roots are this rank's chunks, each sharded over its stage's ``dp_cp`` ranks (experts over
``edp``); the step's calls are the same, made around torch's schedule (``pipeline/path.py``). The stages wrap the
chunks (``pipeline/pipelined.py``), so torch's own FSDP handling in its stages sees no FSDP module and stays out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from lightning_moe_overlap._compat import torch as torch_compat
from lightning_moe_overlap.config import ShardMode
from lightning_moe_overlap.parallel.grad_reduce import BeforeReduce, EarlyReduction, Observer
from lightning_moe_overlap.parallel.mesh import ParallelMesh


def replicate_mesh(mesh: ParallelMesh) -> DeviceMesh:
    """The 2-D ``(dp_cp, unit)`` mesh of this rank's ``dp x cp`` group with a size-1 shard dimension
    (:meth:`ParallelMesh.replicate_mesh`): ``fully_shard`` over it replicates."""
    return mesh.replicate_mesh()


class ShardedModel:
    """The modules ``fully_shard`` was applied to (``roots``: the model at ``pp = 1``, each held chunk at
    ``pp > 1``) and the per-step calls that keep FSDP's communication out of the overlapped pairs."""

    def __init__(
        self, roots: Sequence[FSDPModule], mode: ShardMode = "none", *, overlap_grad_reduce: bool = False,
        before_reduce: BeforeReduce | None = None, held_back: Sequence[nn.Module] = (),
    ) -> None:  # fmt: skip
        self.roots = list(roots)
        self.mode = mode
        # The parameters as the optimizer holds them (sharded DTensors), taken while the modules hold them.
        self.parameters: list[nn.Parameter] = [
            p for root in self.roots for p in root.parameters()  # type: ignore[attr-defined]
        ]  # fmt: skip
        self._fresh = False  # gathered right after an optimizer step: the next step needs no new gather
        # Each unit reduced as soon as its gradients are final in the last backward (sharded modes only).
        self.early: EarlyReduction | None = None
        if overlap_grad_reduce and self.sharded:
            self.early = EarlyReduction(self.named_units(), before_reduce=before_reduce, held_back=held_back)

    @classmethod
    def replicate(cls, roots: Sequence[nn.Module], ignored: Iterable[nn.Parameter], mesh: DeviceMesh) -> ShardedModel:
        """``fully_shard`` each of ``roots`` over the 2-D replicate ``mesh`` (:func:`replicate_mesh`), leaving the
        ``ignored`` parameters (the experts) alone."""
        ignored_ids = {id(p) for p in ignored}
        for root in roots:
            mine = {p for p in root.parameters() if id(p) in ignored_ids}
            fully_shard(root, mesh=mesh, reshard_after_forward=False, ignored_params=mine)
        return cls([root for root in roots if isinstance(root, FSDPModule)], mode="none")

    @classmethod
    def shard(
        cls,
        roots: nn.Module | Sequence[nn.Module],
        experts: Sequence[nn.Module],
        mesh: ParallelMesh,
        mode: ShardMode,
        *,
        mp_policy: MixedPrecisionPolicy | None = None,
        overlap_grad_reduce: bool = False,
        before_reduce: BeforeReduce | None = None,
        held_back: Sequence[nn.Module] = (),
    ) -> ShardedModel:
        """``fully_shard`` each of ``experts`` over ``mesh["edp"]``, then each of ``roots`` (the model at ``pp = 1``,
        this rank's chunks at ``pp > 1``) over ``mesh["dp_cp"]`` (``mode``: ``"optimizer"`` or ``"full"``). Call once
        the replicas are equal and before the optimizer is created. FSDP's forward hooks never reshard
        (``reshard_after_forward=False``): the step does.

        ``overlap_grad_reduce``: also each of the roots' layers (:func:`layer_modules`) over ``mesh["dp_cp"]``,
        between the experts and the root, so that each layer's dense gradients are a unit reduced on its own;
        ``before_reduce`` runs on each unit's gathered parameters just before its early reduction, and the units of
        ``held_back`` (experts whose weight gradients are deferred) are left to the end of the step. The reductions
        run on a lane of their own where a collective blocks the host (gloo, CPU), else on the backward's thread
        (``grad_reduce.py``)."""
        roots = [roots] if isinstance(roots, nn.Module) else list(roots)
        divide = float(mesh.dims.dp * mesh.dims.cp)
        kwargs = {"reshard_after_forward": False, "mp_policy": mp_policy or MixedPrecisionPolicy()}
        modules = [fully_shard(m, mesh=mesh["edp"], **kwargs) for m in experts]  # type: ignore[arg-type]
        layers = [m for root in roots for m in layer_modules(root, experts)] if overlap_grad_reduce else []
        layers = [fully_shard(m, mesh=mesh["dp_cp"], **kwargs) for m in layers]  # type: ignore[arg-type]
        roots = [fully_shard(root, mesh=mesh["dp_cp"], **kwargs) for root in roots]  # type: ignore[misc]
        gloo = dist.get_backend(mesh.group("dp_cp")) == "gloo"  # no pre-multiplied sum: divide afterwards
        units = [*((m, "edp") for m in modules), *((m, "dp_cp") for m in layers), *((r, "dp_cp") for r in roots)]
        for module, kind in units:
            module.set_gradient_divide_factor(divide)
            # Not over one rank: torch then divides both while copying and after the (skipped) reduce-scatter
            module.set_force_sum_reduction_for_comms(gloo and mesh[kind].size() > 1)
        return cls(roots, mode=mode, overlap_grad_reduce=overlap_grad_reduce, before_reduce=before_reduce,
                   held_back=held_back)  # fmt: skip

    @property
    def sharded(self) -> bool:
        """Whether parameters, gradients and optimizer state are sharded (``"optimizer"`` / ``"full"``)."""
        return self.mode != "none"

    def modules(self) -> list[FSDPModule]:
        """Every module under the roots that ``fully_shard`` was applied to (each gathers its own parameters)."""
        return [m for root in self.roots for m in root.modules() if isinstance(m, FSDPModule)]

    def named_units(self) -> list[tuple[str, nn.Module]]:
        """``(name, module)`` of every FSDP unit, in the model's order (a root is ``""``)."""
        return [(n, m) for root in self.roots for n, m in root.named_modules() if isinstance(m, FSDPModule)]

    def observe_reduction(self, observer: Observer | None) -> None:
        """Tell ``observer(event, unit)`` of the early reduction's events (``grad_reduce.EarlyReduction``); for
        tests and benchmarks. Nothing without ``overlap_grad_reduce``."""
        if self.early is not None:
            self.early.observer = observer

    def begin_step(self) -> None:
        """Before the first micro-batch: sync and resharding off, the parameters gathered once (here, on this thread).

        A gathered copy left by an earlier forward (validation) is dropped first: it may predate the last
        optimizer step or a checkpoint load (not the one gathered right after the optimizer step, ``"optimizer"``)."""
        for root in self.roots:
            torch_compat.fsdp_lazy_init(root)
            root.set_is_last_backward(False)
            root.set_requires_gradient_sync(False)
            root.set_reshard_after_backward(False)
        if self.early is not None:
            self.early.reset()
        for module in self.modules():
            if not self._fresh:
                module.reshard()
            module.unshard()
        self._fresh = False
        if self.sharded:
            for root in self.roots:
                torch_compat.fsdp_set_hooks_idle(root, True)

    def before_last_backward(self, root: nn.Module | None = None) -> None:
        """Just before a last backward that runs alone (the step's, or at ``pp > 1`` that of the held chunk
        ``root``): with ``overlap_grad_reduce``, gradient sync on for those units and each one's reduction issued as
        soon as its gradients are final (``grad_reduce.py``); resharding stays off until :meth:`end_step`.
        Otherwise nothing."""
        if self.early is None:
            return
        for module in self.roots if root is None else [root]:
            module.set_is_last_backward(True)
            module.set_requires_gradient_sync(True)
        self.early.arm(root)

    def divide_gradients(self, divisor: int | None) -> None:
        """With ``overlap_grad_reduce`` at ``pp > 1``: divide every unit's gradients by ``divisor`` just before its
        reduction, in place of torch's schedule, whose division after the last backward would come after the early
        reductions (the strategy builds the schedule without it; ``EarlyReduction._divide``). None: nothing."""
        if self.early is not None:
            self.early.grad_divisor = divisor

    def end_step(self, before_rest: Callable[[], None] | None = None) -> None:
        """After the last micro-batch's backward: reduce the accumulated gradients (reduce-scatter in the sharded
        modes; with ``overlap_grad_reduce`` only the units not reduced during the backward, after waiting for
        those) and reshard; FSDP's hooks are active again afterwards. ``before_rest`` runs before the reductions
        left (all of them without ``overlap_grad_reduce``), once the early ones are done."""
        if self.early is not None:
            self.early.finish()
        if before_rest is not None:
            before_rest()
        for root in self.roots:
            root.set_is_last_backward(True)
            root.set_requires_gradient_sync(True)
            root.set_reshard_after_backward(True)
            torch_compat.fsdp_reduce_gradients(root)  # leaves every FSDP state idle, its hooks active

    def after_optimizer_step(self) -> None:
        """``"optimizer"``: gather the updated parameters now, the full parameters being what it keeps between
        steps. Other modes: nothing. Collective."""
        if self.mode == "optimizer":
            self.gather()
            self._fresh = True

    def rows_moved(self, modules: Sequence[nn.Module]) -> None:
        """After rows of these (resharded) modules' sharded parameters were rewritten (an expert re-placement):
        ``"optimizer"`` gathers them again now (full parameters at rest); every mode gathers afresh at the next
        step. Collective over the modules' shard groups in ``"optimizer"``."""
        if self.mode == "optimizer":
            for module in modules:
                module.unshard()  # type: ignore[operator]
        self._fresh = False

    def gather(self) -> None:
        """Gather every parameter (collective over the shard groups; nothing for those already gathered): the
        model's submodules can then be called directly, their parameters being plain tensors once gathered."""
        for root in self.roots:
            torch_compat.fsdp_lazy_init(root)
        for module in self.modules():
            module.unshard()

    def release(self) -> None:
        """After a checkpoint's ``state_dict()`` (which reshards) and at the end of a run: leave the parameters
        gathered in modes ``"none"`` (so that the model can be called as before; gathering over a size-1 shard
        dimension communicates with no other rank, so this is safe in a teardown after another rank failed) and
        ``"optimizer"`` (its state at rest); ``"full"`` keeps them sharded."""
        if self.mode == "none":
            self.gather()
        elif self.mode == "optimizer":
            self.gather()
            self._fresh = False


def layer_modules(model: nn.Module, experts: Sequence[nn.Module]) -> list[nn.Module]:
    """The model's layers: every element of a ``nn.ModuleList`` or ``nn.ModuleDict`` that holds one of ``experts``
    (``model.layers[i]`` of ``MoEGPT`` and HF models; a pipeline chunk's layers, kept in a ``ModuleDict`` under their
    unsplit indices), outermost containers first; an element inside another layer is not one."""
    expert_ids = {id(m) for m in experts}
    layers: list[nn.Module] = []
    taken: set[int] = set()
    for module in model.modules():
        if not isinstance(module, nn.ModuleList | nn.ModuleDict) or id(module) in taken:
            continue
        for element in module.values() if isinstance(module, nn.ModuleDict) else module:
            inside = {id(m) for m in element.modules()}
            if inside & expert_ids and id(element) not in taken:
                layers.append(element)
                taken |= inside
    return layers
