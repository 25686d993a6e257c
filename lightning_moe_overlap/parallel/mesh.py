"""One ``DeviceMesh`` over the rank layout of :class:`ParallelDims`, with a 1-D view per group kind.

The mesh is what torch's engine takes (``fully_shard`` over ``dp_cp`` for dense parameters and over ``edp`` for
experts, ``DTensor`` experts sharded over ``ep``); ``ParallelDims`` stays the one source of sizes and layout, and the
mesh is derived from it so that every rank has the same coordinates in both (``ParallelDims.coords``).

Layout. The ranks are ``(pp, [dp x cp block], tp)`` with ``tp`` fastest, and the ``dp x cp`` block is read two ways:
``(dp, cp)`` for dense parameters and ``(edp, ep)`` for experts, ``ep`` fastest (Megatron's layout). A mesh has one
row-major order, so the block is cut into the three dimensions both readings are made of, inner size
``min(cp, ep)``::

    ep divides cp:  (pp, dp,  cp_in_edp, ep, tp)   cp = cp_in_edp x ep,  edp = dp x cp_in_edp
    cp divides ep:  (pp, edp, dp_in_ep,  cp, tp)   dp = edp x dp_in_ep,  ep  = dp_in_ep x cp

(``cp_in_edp = cp / ep``, ``dp_in_ep = ep / cp``; with ``cp == ep`` the first form is used, ``cp_in_edp = 1``). The
other kinds and ``dp_cp`` (the whole block) are flattened views of those dimensions. When neither of ``cp`` and
``ep`` divides the other, no such cut exists and :func:`mesh_layout` refuses the sizes.
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
        NotImplementedError: neither of ``cp`` and ``ep`` divides the other (only reachable with ``cp > 1``).
    """
    cp, ep = dims.cp, dims.ep
    if cp % ep == 0:  # ep inside cp: (dp, cp_in_edp, ep)
        block = (("dp", dims.dp), ("cp_in_edp", cp // ep), ("ep", ep))
        views: dict[GroupKind, tuple[str, ...]] = {
            "dp": ("dp",),
            "cp": ("cp_in_edp", "ep"),
            "ep": ("ep",),
            "edp": ("dp", "cp_in_edp"),
        }
    elif ep % cp == 0:  # cp inside ep: (edp, dp_in_ep, cp)
        block = (("edp", dims.edp), ("dp_in_ep", ep // cp), ("cp", cp))
        views = {"dp": ("edp", "dp_in_ep"), "cp": ("cp",), "ep": ("dp_in_ep", "cp"), "edp": ("edp",)}
    else:
        raise NotImplementedError(
            f"`build_mesh`: cp={cp} and ep={ep} ({dims.describe()}) cannot be one DeviceMesh: ep groups are runs of "
            f"{ep} consecutive ranks of the dp x cp block and cp groups runs of {cp}, and a mesh can hold both only "
            f"when one of cp and ep divides the other. Choose ep among the divisors or multiples of cp={cp} that "
            f"divide dp*cp={dims.dp * cp}: {_nested_choices(cp, dims.dp * cp)}."
        )
    names = ("pp", *(name for name, _ in block), "tp")
    views.update({"dp_cp": tuple(name for name, _ in block), "pp": ("pp",), "tp": ("tp",)})
    return MeshLayout(names=names, shape=(dims.pp, *(size for _, size in block), dims.tp), views=views)


def _nested_choices(cp: int, block: int) -> list[int]:
    return [e for e in range(1, block + 1) if block % e == 0 and (cp % e == 0 or e % cp == 0)]


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

    def __getitem__(self, kind: GroupKind) -> DeviceMesh:
        """The 1-D mesh of ``kind`` that this rank belongs to."""
        if kind not in self.views:
            raise KeyError(f"`ParallelMesh`: unknown kind={kind!r}; valid kinds: {list(GROUP_KINDS)}.")
        return self.views[kind]

    def group(self, kind: GroupKind) -> ProcessGroup:
        """This rank's process group of ``kind`` (the group of the 1-D view)."""
        return self[kind].get_group()

    def process_groups(self, rank: int) -> ParallelGroups:
        """This rank's :class:`ParallelGroups`, read off the views (no new communicator)."""
        return ParallelGroups(dims=self.dims, rank=rank, **{kind: self.group(kind) for kind in GROUP_KINDS})


def build_mesh(
    dims: ParallelDims, device_type: str, *, backend: str | None = None, timeout: timedelta | None = None
) -> ParallelMesh:
    """Build the mesh of ``dims`` on ``device_type`` (``"cuda"``, ``"cpu"``). Collective: every rank calls it with
    the same ``dims``, after the default process group is initialised.

    Every group of the mesh (each dimension's, each flattened view's) is made with ``backend`` (default: the default
    group's) and ``timeout``; the ep groups on NCCL get the high-priority stream of
    :func:`~lightning_moe_overlap.parallel.groups.group_options`. Dimensions of size 1 are kept, so every kind has a
    view whatever the sizes. :meth:`ParallelGroups.from_mesh` reads the process groups off the views: the mesh is the
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
        else:
            config = _backend_config(resolved, kind, timeout)
            views[kind] = torch_compat.flatten_mesh(device_mesh[parts], kind, backend_override=config)
    return ParallelMesh(dims=dims, layout=layout, device_mesh=device_mesh, views=views)


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
