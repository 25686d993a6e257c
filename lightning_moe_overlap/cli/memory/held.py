"""The bytes of parameters, gradients and optimizer state one process holds, from the parameters of a model built on
the meta device (their global shapes) and the layout (docs/sharding.md).

Per parameter, the elements this process computes with (``local``): an experts tensor ``[E, ...]`` holds
``E / ep`` rows; a tensor the tensor-parallel plan shards holds ``1 / tp`` of the sharded dimension. Under
``shard="optimizer" | "full"`` (FSDP2) each of those is cut on dim 0 over the dense ``dp x cp`` ranks (experts: over
``edp``), each rank holding ``ceil(rows / n)`` rows: FSDP pads dim 0 to a multiple of ``n``, so every rank's shard
has that size (the first rank's is the largest whatever the padding; the table is for it).

What the step holds (``parallelize/sharding.py``): the parameters are gathered once before the first micro-batch
and the gradients accumulate, unsharded, in the gathered parameters until the last backward; then they are
reduce-scattered to the shards. So at the step's peak a sharded rank holds its shards, the gathered copies and the
unsharded gradients; ``shard="none"`` holds the parameters, a gathered copy of the dense ones (FSDP on the
``(dp_cp, 1)`` replicate mesh gathers into its own buffer: measured, ``benchmarks/memory_check.py``) and the
gradients once.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace

from torch import nn

from lightning_moe_overlap.cli.memory.optimizer_state import OptimizerState
from lightning_moe_overlap.optim.host_offload import largest_first


@dataclass(frozen=True)
class Layout:
    """The sizes that cut a parameter, and the dtypes it is kept in.

    Attributes:
        ep: expert parallelism (experts ``E / ep`` per rank).
        tp: tensor parallelism (the plan's sharded dimensions ``1 / tp``).
        dp_cp: the ranks the dense parameters are sharded over in the sharded modes (``dp x cp`` of a pp stage).
        edp: the ranks the experts are sharded over in the sharded modes (``dp x cp x tp / ep``).
        shard: ``"none"``, ``"optimizer"`` or ``"full"``.
        param_bytes: bytes per element of the parameters as kept (4 for fp32 and ``*-mixed``, 2 for ``bf16-true``).
        compute_bytes: bytes per element of the gathered copies and the gradients (FSDP's ``param_dtype``; else
            ``param_bytes``).
        offload_fraction: the share of the elements whose optimizer state is in host memory; None without offload.
    """

    ep: int = 1
    tp: int = 1
    dp_cp: int = 1
    edp: int = 1
    shard: str = "none"
    param_bytes: int = 4
    compute_bytes: int = 4
    offload_fraction: float | None = None


@dataclass(frozen=True)
class HeldBytes:
    """Bytes one process holds for its parameters, gradients and optimizer state.

    Attributes:
        params: the parameters as kept (the shards in the sharded modes).
        gathered: the gathered (unsharded) copies that exist during the step; at ``shard="none"`` the dense
            parameters' (FSDP over a shard dimension of one rank still gathers into a buffer of its own; the experts
            are not under FSDP there).
        grads: the gradients at the step's peak: unsharded, in the compute dtype.
        grads_after: the gradients after the reduction (the shards in the sharded modes).
        optimizer: the optimizer's state on the device.
        host: the optimizer's state and the host copies of the offloaded parameters (optimizer offload).
    """

    params: int
    gathered: int
    grads: int
    grads_after: int
    optimizer: int
    host: int


def local_numel(shape: tuple[int, ...], *, expert: bool, tp_dim: int | None, layout: Layout) -> tuple[int, ...]:
    """The shape this process computes with: experts ``E / ep`` rows, the tp-sharded dimension ``/ tp``."""
    out = list(shape)
    if expert and out:
        out[0] = out[0] // layout.ep
    if tp_dim is not None and out:
        out[tp_dim] = math.ceil(out[tp_dim] / layout.tp)
    return tuple(out)


def shard_numel(shape: tuple[int, ...], ranks: int) -> int:
    """Elements of one FSDP shard of ``shape`` over ``ranks``: ``ceil(rows / ranks)`` rows (dim 0 padded)."""
    if not shape:
        return 1
    return math.ceil(shape[0] / ranks) * math.prod(shape[1:])


def held_bytes(
    params: Iterable[tuple[nn.Parameter, bool, int | None]], layout: Layout, optimizer: OptimizerState
) -> HeldBytes:
    """:class:`HeldBytes` of ``params``: ``(parameter on meta, is an experts tensor, tp-sharded dim or None)``."""
    sharded = layout.shard != "none"
    rows: list[tuple[int, int]] = []  # (local elements, shard elements)
    dense = 0
    for p, expert, tp_dim in params:
        local = local_numel(tuple(p.shape), expert=expert, tp_dim=tp_dim, layout=layout)
        n = (layout.edp if expert else layout.dp_cp) if sharded else 1
        rows.append((math.prod(local), shard_numel(local, n)))
        dense += 0 if expert else math.prod(local)
    kept = sum(s for _, s in rows)
    full = sum(lo for lo, _ in rows)
    offloaded = _offloaded(sorted((s for _, s in rows), reverse=True), layout.offload_fraction)
    on_device = kept - sum(offloaded)
    state_bytes = optimizer.states * layout.param_bytes
    device_optim = on_device * state_bytes + (len(rows) - len(offloaded)) * optimizer.scalar_bytes
    return HeldBytes(
        params=kept * layout.param_bytes,
        gathered=full * layout.compute_bytes if sharded else dense * layout.param_bytes,
        grads=full * layout.compute_bytes,
        grads_after=kept * layout.param_bytes,
        optimizer=device_optim,
        host=_host_bytes(offloaded, layout.param_bytes, optimizer),
    )


def _offloaded(sizes_desc: list[int], fraction: float | None) -> list[int]:
    """The shard sizes whose state goes to the host, by the offload's own rule (``largest_first``)."""
    if fraction is None:
        return []
    return [sizes_desc[i] for i in largest_first(sizes_desc, fraction)]


def _host_bytes(offloaded: list[int], param_bytes: int, optimizer: OptimizerState) -> int:
    """Host bytes of the offloaded parameters (``optim/host_copy.py``): a master copy and its gradient (float32
    where the parameter is in a lower precision, plus two staging buffers in its dtype), the state in the master's
    dtype and the per-parameter scalars."""
    master = max(param_bytes, 4)
    staging = 2 * param_bytes if param_bytes < 4 else 0
    per_element = 2 * master + staging + optimizer.states * master
    return sum(offloaded) * per_element + len(offloaded) * optimizer.scalar_bytes


def tp_sharded_dims(model: nn.Module, tp: int) -> Mapping[str, int]:
    """``{parameter name: sharded dim}`` under the model's tensor-parallel plan at ``tp`` (``{}`` at ``tp = 1``):
    the plan's ``ColwiseParallel`` / ``RowwiseParallel`` entries on ``nn.Linear`` (weight rows / columns, a column
    style's bias) and ``nn.Embedding`` (columns / rows). The plan is read from a copy of the meta model (a plan hook
    may set attributes on it) with a stand-in mesh of ``tp`` ranks.

    Raises:
        ValueError: the plan cannot be built (the hook's or ``plan_of``'s own message).
    """
    import fnmatch

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from lightning_moe_overlap.parallelize.tensor_plan import plan_of

    if tp == 1:
        return {}
    mesh = SimpleNamespace(size=lambda *a: tp, get_local_rank=lambda *a: 0, ndim=1)
    plan = plan_of(copy.deepcopy(model), mesh)  # type: ignore[arg-type]
    dims: dict[str, int] = {}
    for name, module in model.named_modules():
        styles = [s for pattern, s in plan.items() if fnmatch.fnmatch(name, pattern)]
        col = any(isinstance(s, ColwiseParallel) for s in styles)
        row = any(isinstance(s, RowwiseParallel) for s in styles)
        if not (col or row):
            continue
        if isinstance(module, nn.Embedding):
            dims[f"{name}.weight"] = 1 if col else 0
        elif isinstance(module, nn.Linear):
            dims[f"{name}.weight"] = 0 if col else 1
            if col and module.bias is not None:
                dims[f"{name}.bias"] = 0
    return dims
