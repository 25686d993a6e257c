"""One ``DeviceMesh`` over the rank layout of :class:`ParallelDims`, with a 1-D view per group kind.

The mesh is what torch's engine takes (``fully_shard`` over ``dp_cp`` for dense parameters and over ``edp`` for
experts, ``DTensor`` experts sharded over ``ep``, ``parallelize_module`` over ``tp``); ``ParallelDims`` stays the one
source of sizes and layout, and the mesh is derived from it so that every rank has the same coordinates in both
(``ParallelDims.coords``).

Layout. The ranks are ``(pp, [dp x cp x tp block], unit)`` with ``tp`` fastest inside the block, and the block is
read two ways: ``(dp, cp, tp)`` for dense parameters and ``(edp, ep)`` for experts, ``ep`` fastest (Megatron's
parallel folding). A mesh has one row-major order, so the block is cut into dimensions both readings are made of:
``ep`` is the innermost run of the block, so walking ``tp``, ``cp``, ``dp`` from the inside, each dimension lies
wholly in ``ep`` while ``ep`` still needs it, one dimension at most is split in two (``{name}_edp`` outside,
``{name}_ep`` inside), and the rest lie wholly in ``edp``. Examples (``pp`` and ``unit`` left out)::

    dp=4 cp=1 tp=1 ep=2:  (dp_edp=2, dp_ep=2, cp=1, tp=1)     ep = (dp_ep, cp, tp), edp = (dp_edp,)
    dp=4 cp=4 tp=1 ep=2:  (dp=4, cp_edp=2, cp_ep=2, tp=1)     ep = (cp_ep, tp),      edp = (dp, cp_edp)
    dp=2 cp=1 tp=4 ep=2:  (dp=2, cp=1, tp_edp=2, tp_ep=2)     ep = (tp_ep,),         edp = (dp, cp, tp_edp)
    dp=2 cp=1 tp=2 ep=2:  (dp=2, cp=1, tp=2)                  ep = (tp,),            edp = (dp, cp)

A kind made of several dimensions is a flattened view of them; ``ep`` (``edp``) gets a size-1 dimension of its own
name when no dimension lies in it. ``unit``, the last dimension, has size 1: the size-1 shard dimension of the
replicated parameters' 2-D mesh (``parallelize/sharding.py``). When the split dimension's size is not a multiple of
what ``ep`` still needs (``cp=2, ep=3``), no such cut exists and :func:`mesh_layout` refuses the sizes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_moe_overlap._compat import torch as torch_compat
from lightning_moe_overlap.parallel.dims import GROUP_KINDS, GroupKind, ParallelDims
from lightning_moe_overlap.parallel.groups import ParallelGroups, group_options


@dataclass(frozen=True)
class MeshLayout:
    """The mesh's dimensions (``names`` and ``shape``, row-major over the global ranks) and, for each group kind,
    the dimensions its 1-D view is made of (``views[kind]``, outermost first; one name: the dimension itself)."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    views: dict[GroupKind, tuple[str, ...]]


def mesh_layout(dims: ParallelDims) -> MeshLayout:
    """The mesh dimensions that reproduce ``dims``'s rank layout (pure: no process group).

    Raises:
        NotImplementedError: the innermost ``ep`` ranks of the block are not a run of whole dimensions and one part
            of a dimension (e.g. ``cp=2, ep=3``).
    """
    parts = _block_parts(dims)
    if parts is None:
        name, size = _uneven_dimension(dims)
        raise NotImplementedError(
            f"`build_mesh`: ep={dims.ep} ({dims.describe()}) cannot be one DeviceMesh with these sizes: an ep group "
            f"is a run of {dims.ep} consecutive ranks of the dp x cp x tp block (tp fastest), and with {name}={size} "
            f"it would hold part of a {name} group and a part of the next that is not a whole number of {name} "
            f"groups. Choose ep among the values whose run is made of whole dimensions and one divisor of a "
            f"dimension: {_nested_choices(dims)}."
        )
    block = [part for name in ("dp", "cp", "tp") for part in parts[name]]
    if not any(kind == "edp" for _, _, kind in block):
        block.insert(0, ("edp", 1, "edp"))
    if not any(kind == "ep" for _, _, kind in block):
        block.append(("ep", 1, "ep"))
    names = ("pp", *(name for name, _, _ in block), UNIT)
    shape = (dims.pp, *(size for _, size, _ in block), 1)

    def view(*dense: str) -> tuple[str, ...]:
        return tuple(name for d in dense for name, _, _ in parts[d])

    views: dict[GroupKind, tuple[str, ...]] = {
        "pp": ("pp",),
        "dp": view("dp"),
        "cp": view("cp"),
        "tp": view("tp"),
        "cp_tp": view("cp", "tp"),
        "dp_cp": view("dp", "cp"),
        "dp_cp_tp": view("dp", "cp", "tp"),
        "ep": tuple(name for name, _, kind in block if kind == "ep"),
        "edp": tuple(name for name, _, kind in block if kind == "edp"),
    }
    return MeshLayout(names=names, shape=shape, views=views)


UNIT = "unit"


def _block_parts(dims: ParallelDims) -> dict[str, list[tuple[str, int, str]]] | None:
    """Each dense dimension's mesh dimensions ``[(name, size, "ep" | "edp")]``, walking the block from the inside
    (``ep`` takes whole dimensions, then one part of one); None when ``ep`` would take an uneven part."""
    need = dims.ep
    parts: dict[str, list[tuple[str, int, str]]] = {}
    for name, size in (("tp", dims.tp), ("cp", dims.cp), ("dp", dims.dp)):  # innermost first
        if need == 1:
            parts[name] = [(name, size, "edp")]
        elif need % size == 0:
            parts[name] = [(name, size, "ep")]
            need //= size
        elif size % need == 0:
            parts[name] = [(f"{name}_edp", size // need, "edp"), (f"{name}_ep", need, "ep")]
            need = 1
        else:
            return None
    return parts


def _uneven_dimension(dims: ParallelDims) -> tuple[str, int]:
    need = dims.ep
    for name, size in (("tp", dims.tp), ("cp", dims.cp), ("dp", dims.dp)):
        if need % size == 0:
            need //= size
        else:
            return name, size
    raise AssertionError("only called for sizes without a layout")


def _nested_choices(dims: ParallelDims) -> list[int]:
    """The ep values of ``dims``'s block that have a layout."""
    span = dims.ep_span
    return [
        ep for ep in range(1, span + 1)
        if span % ep == 0 and _block_parts(ParallelDims(dims.world_size, dims.dp, dims.tp, dims.pp, dims.cp, ep))
    ]  # fmt: skip


@dataclass(frozen=True)
class ParallelMesh:
    """A ``DeviceMesh`` over the whole world (``device_mesh``, dimensions as in :func:`mesh_layout`) and this rank's
    1-D view of it per group kind: ``mesh["dp_cp"]`` (dense sharding), ``mesh["edp"]`` (expert sharding),
    ``mesh["ep"]`` (expert ``DTensor`` placement), and ``dp``, ``cp``, ``tp``, ``pp``. Each view's group has the
    members of the ``ParallelGroups`` group of the same kind, in the same order.

    The flattened views are kept here rather than sliced from ``device_mesh`` by name (torch deprecates slicing a
    flattened dimension from the root mesh).
    """

    dims: ParallelDims
    layout: MeshLayout
    device_mesh: DeviceMesh
    views: Mapping[GroupKind, DeviceMesh]
    timeout: timedelta | None = None  # of every group made for it (None: torch's default)

    def __getitem__(self, kind: GroupKind) -> DeviceMesh:
        """The 1-D mesh of ``kind`` that this rank belongs to."""
        if kind not in self.views:
            raise KeyError(f"`ParallelMesh`: unknown kind={kind!r}; valid kinds: {list(GROUP_KINDS)}.")
        return self.views[kind]

    def group(self, kind: GroupKind) -> ProcessGroup:
        """This rank's process group of ``kind`` (the group of the 1-D view)."""
        return self[kind].get_group()

    def replicate_mesh(self) -> DeviceMesh:
        """The 2-D ``(dp_cp, unit)`` mesh of this rank's ``dp x cp`` group with a size-1 shard dimension, sliced from
        the root mesh (so that it composes with ``DTensor`` parameters over ``tp``): ``fully_shard`` over it
        replicates (``parallelize/sharding.py``). No new communicator."""
        parts = self.layout.views["dp_cp"]
        return self.device_mesh[(parts[0] if len(parts) == 1 else "dp_cp", UNIT)]

    def process_groups(self, rank: int) -> ParallelGroups:
        """This rank's :class:`ParallelGroups`, read off the views (no new communicator)."""
        return ParallelGroups(dims=self.dims, rank=rank, **{kind: self.group(kind) for kind in GROUP_KINDS})

    def side_group(self, kind: GroupKind, rank: int) -> ProcessGroup:
        """A second communicator over this rank's group of ``kind`` (the same members in the same order), for
        collectives another thread issues while the step's own thread may issue its own on ``kind`` (a group's
        collectives pair up by their order of issue, and two threads would interleave them differently on each
        rank). Collective: every rank calls it, for the same kinds in the same order; made with the default group's
        backend and the mesh's timeout."""
        rank_lists = sorted({tuple(self.dims.group_of(kind, r)) for r in range(self.dims.world_size)})
        mine, _ = dist.new_subgroups_by_enumeration([list(ranks) for ranks in rank_lists], timeout=self.timeout)
        assert dist.get_process_group_ranks(mine) == self.dims.group_of(kind, rank), "side group members"
        return mine


def build_mesh(
    dims: ParallelDims, device_type: str, *, backend: str | None = None, timeout: timedelta | None = None
) -> ParallelMesh:
    """Build the mesh of ``dims`` on ``device_type`` (``"cuda"``, ``"cpu"``). Collective: every rank calls it with
    the same ``dims``, after the default process group is initialised.

    Every group of the mesh (each dimension's, each flattened view's) is made with ``backend`` (default: the default
    group's) and ``timeout``; the ep groups on NCCL get the high-priority stream of
    :func:`~lightning_moe_overlap.parallel.groups.group_options`. Dimensions of size 1 are kept, so every kind has a
    view whatever the sizes. :meth:`ParallelMesh.process_groups` reads the process groups off the views: the mesh is the
    one set of communicators of a run.

    Raises:
        NotImplementedError: the sizes have no mesh (see :func:`mesh_layout`).
        RuntimeError: the running world size is not ``dims.world_size``.
    """
    layout = mesh_layout(dims)
    if not dist.is_initialized() or dist.get_world_size() != dims.world_size:
        running = dist.get_world_size() if dist.is_initialized() else None
        raise RuntimeError(
            f"`build_mesh`: the dims were built for world_size={dims.world_size} but the default process group has "
            f"world_size={running}. Initialise the process group first and build `ParallelDims` from its world size."
        )
    resolved = backend or str(dist.get_backend())
    ep_parts = layout.views["ep"]
    overrides = {
        name: _backend_config(resolved, "ep" if ep_parts == (name,) else "other", timeout) for name in layout.names
    }
    device_mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=layout.names, backend_override=overrides)
    views: dict[GroupKind, DeviceMesh] = {}
    for kind in GROUP_KINDS:
        parts = layout.views[kind]
        if len(parts) == 1:
            views[kind] = device_mesh[parts[0]]
        elif kind == "dp_cp_tp" and dims.tp == 1:  # the dp_cp ranks: its view, no second communicator
            views[kind] = views["dp_cp"]
        elif kind == "cp_tp" and (dims.cp == 1 or dims.tp == 1):  # the tp (or cp) ranks: that view
            views[kind] = views["tp" if dims.cp == 1 else "cp"]
        else:
            config = _backend_config(resolved, kind, timeout)
            views[kind] = torch_compat.flatten_mesh(device_mesh[parts], kind, backend_override=config)
    return ParallelMesh(dims=dims, layout=layout, device_mesh=device_mesh, views=views, timeout=timeout)


def _backend_config(backend: str, kind: str, timeout: timedelta | None) -> tuple[str, Any]:
    """``(backend, options)`` of one mesh group: the high-priority stream for ep on NCCL (:func:`group_options`),
    and ``timeout`` (``None``: the backend's default) on every group."""
    options = group_options(kind, backend)
    if timeout is not None:
        options = options if options is not None else _plain_options(backend)
        if options is not None:
            options = torch_compat.set_options_timeout(options, timeout)
    return backend, options


def _plain_options(backend: str) -> Any:
    """The backend's default options object (to carry a timeout); ``None`` for a backend without one."""
    if backend.lower() == "nccl":
        return dist.ProcessGroupNCCL.Options()  # only on NCCL builds of torch, reached only with an NCCL backend
    if backend.lower() == "gloo":
        return torch_compat.gloo_options()
    return None
