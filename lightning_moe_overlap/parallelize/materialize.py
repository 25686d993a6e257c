"""Give a model built on the meta device its tensors, each rank allocating only what it holds.

``configure_model`` runs under the meta device (``MoEOverlapStrategy.model_sharded_context``), so the model has
shapes and no memory. Steps of ``parallelize/steps.py`` allocate and initialise what this rank holds:

- :func:`materialize_dense`: every held module with tensors on meta, except the experts modules, gets its tensors
  whole and is initialised (``shard="none"``: the dense parameters are replicas);
- with ``shard="optimizer" | "full"`` the modules with parameters are left on meta instead (:func:`defer_dense`)
  through tp, fp8, the precision plugin and ``fully_shard``, and :func:`materialize_deferred` then gives them their
  values: each rank allocates only its shards, and one module at a time has its tensors built whole (transiently),
  initialised, and this rank's part copied into its shards. No rank holds a stage's dense part whole: the largest
  transient is one module's own tensors (the embedding, say);
- :func:`find_meta_experts` before the experts are made expert-parallel, :func:`materialize_experts` after: each
  experts module's own slice is allocated and, one layer at a time, the layer's full experts are initialised, the
  slice kept and the rest freed. With weights to load (:attr:`MetaInit.experts_empty`) the slice stays
  uninitialised and no full layer is built.

Values: every module is initialised by ``init_module`` under ``module_seed(seed, its unsplit name)``
(:func:`~lightning_moe_overlap.pipeline.split.seeded_init`), so they equal ``seeded_init(unsplit model, seed,
init_module)`` at any ep, dp and pp. ``init_module`` is the LightningModule's :func:`init_module_of` hook.

Tensors shared by several modules (tied weights) stay shared: each is allocated once and every owner gets it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from lightning_moe_overlap._compat import torch as torch_compat
from lightning_moe_overlap.hf.load import HFWeights, as_hf_weights_list
from lightning_moe_overlap.hf.planner import chunk_of
from lightning_moe_overlap.moe.adapters import find_experts
from lightning_moe_overlap.moe.ep import ExpertParallelExperts
from lightning_moe_overlap.parallel.dtensors import local
from lightning_moe_overlap.pipeline.chunks import InitModule
from lightning_moe_overlap.pipeline.split import SplitModel, init_one_seeded, reset_module

BUILD_ON_META = "build_on_meta"  # a LightningModule's opt-out: False builds `configure_model` with real tensors
DEPRECATED_BUILD_ON_META = "pipeline_build_on_meta"  # the former name (pp > 1 only), read with a warning
INIT_HOOK = "init_module"  # the LightningModule's method: init_module(module) initialises one module's own tensors
WEIGHTS_ATTR = "hf_weights"  # not None: checkpoints fill the weights after setup (the experts are left empty)


@dataclass(frozen=True)
class MetaInit:
    """How tensors built on the meta device get their values.

    Attributes:
        device: where they are allocated.
        seed: the run's seed (``torch.initial_seed()``); each module's stream is ``module_seed(seed, its name)``.
        init_module: initialises one module's own parameters and buffers (not its children's).
        experts_empty: a checkpoint will fill the weights: the experts' slices are allocated and not initialised.
    """

    device: torch.device
    seed: int
    init_module: InitModule
    experts_empty: bool = False


def build_on_meta(module: nn.Module | None) -> bool:
    """Whether ``configure_model`` of ``module`` runs under the meta device: its ``build_on_meta`` attribute (class or
    instance; True when absent). The former ``pipeline_build_on_meta`` is read when ``build_on_meta`` is absent, with
    a ``FutureWarning`` naming the new attribute."""
    if module is None:
        return True
    if hasattr(module, BUILD_ON_META):
        return bool(getattr(module, BUILD_ON_META))
    if hasattr(module, DEPRECATED_BUILD_ON_META):
        value = bool(getattr(module, DEPRECATED_BUILD_ON_META))
        rank_zero_warn(
            f"`{type(module).__name__}.{DEPRECATED_BUILD_ON_META} = {value}` is deprecated: `configure_model` now runs "
            f"under the meta device at every pp, not only at pp > 1. Rename it to `{BUILD_ON_META} = {value}` (same "
            "meaning, at every pp).",
            category=FutureWarning,
        )
        return value
    return True


def init_module_of(module: nn.Module, split: SplitModel | None = None) -> InitModule:
    """The function that initialises one module of ``module`` (a LightningModule), first found wins:

    1. its ``init_module(module)`` method (the hook; the demo modules define it);
    2. at ``pp > 1``, the splitter's ``PipelineChunks.init_module``;
    3. for a Hugging Face decoder LM (itself or its ``model`` attribute), its ``_init_weights``; with several HF
       models in ``module`` (each ``from_pretrained`` of ``configure_model``, say), each module inside one of them
       by that model's ``_init_weights`` (its rotary buffers, which no checkpoint holds, among them);
    4. :func:`~lightning_moe_overlap.pipeline.split.reset_module` (``reset_parameters()``).
    """
    hook = getattr(module, INIT_HOOK, None)
    if callable(hook):
        return hook
    if split is not None and split.init_module is not None:
        return split.init_module
    from lightning_moe_overlap.pipeline.splitters import find_hf_decoder

    hf = find_hf_decoder(module)
    rest = reset_module if hf is None else hf._init_weights
    owners = _hf_owners(module)
    if len({id(m) for m in owners.values()}) <= 1 and (hf is not None or not owners):
        return rest
    return lambda m: owners[id(m)]._init_weights(m) if id(m) in owners else rest(m)


def _hf_owners(module: nn.Module) -> dict[int, nn.Module]:
    """``id(submodule)`` -> the outermost Hugging Face ``PreTrainedModel`` of ``module`` that holds it (empty without
    transformers)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - depends on the environment
        return {}
    owners: dict[int, nn.Module] = {}
    for m in module.modules():
        if isinstance(m, PreTrainedModel) and id(m) not in owners:
            owners.update((id(sub), m) for sub in m.modules() if id(sub) not in owners)
    return owners


def declare_weights(module: nn.Module, found: Sequence[HFWeights]) -> list[HFWeights]:
    """Add ``found`` (the weights of HF models recognised in ``module``, each under its attribute path) to what
    ``module.hf_weights`` declares, except those under a prefix the module's own declaration covers (its own are
    kept); returns the ones added. ``hf_weights`` becomes one ``HFWeights``, or a list when there are several.

    Raises:
        ValueError: two declared prefixes overlap (:func:`~lightning_moe_overlap.hf.load.as_hf_weights_list`).
    """
    owner = f"`{type(module).__name__}`"
    own = as_hf_weights_list(getattr(module, WEIGHTS_ATTR, None), owner)
    added = [w for w in found if not any(w.prefix.startswith(o.prefix) or o.prefix.startswith(w.prefix) for o in own)]
    if added:
        every = as_hf_weights_list([*own, *added], owner)
        setattr(module, WEIGHTS_ATTR, every[0] if len(every) == 1 else every)
    return added


def meta_init_of(
    module: nn.Module, device: torch.device, seed: int, split: SplitModel | None = None
) -> MetaInit:
    """The :class:`MetaInit` of a LightningModule: its init hook, and empty experts when it declares weights to load
    (an ``hf_weights`` attribute that is not None nor empty)."""
    empty = getattr(module, WEIGHTS_ATTR, None) not in (None, [], ())
    return MetaInit(torch.device(device), seed, init_module_of(module, split), experts_empty=empty)


# -- dense -------------------------------------------------------------------------------------------------------
def materialize_dense(
    model: nn.Module, init: MetaInit, roots: Sequence[nn.Module] | None = None, exclude: DeferredDense | None = None
) -> list[str]:
    """Allocate on ``init.device`` and initialise every module of ``roots`` (``None``: all of ``model``) with tensors
    on meta, the experts modules (and modules inside them) and those of ``exclude`` excepted; returns their names in
    ``model``.

    Names are ``model``'s (the unsplit model at ``pp > 1``, whose modules the chunks share), so the values equal
    ``seeded_init(model, init.seed, init.init_module)`` for those modules, whatever else is allocated.
    """
    names = {id(m): n for n, m in model.named_modules()}
    skip = set() if exclude is None else set(exclude.modules)
    targets = [(name, m) for name, m in _dense_targets(model, roots) if name not in skip]
    allocate([m for _, m in targets], init.device)
    for name, m in targets:
        init_one_seeded(m, init.seed, names.get(id(m), name), init.init_module)
    return [name for name, _ in targets]


# -- dense, sharded ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeferredDense:
    """Dense modules left on the meta device until ``fully_shard`` has given their tensors their final placement.

    Attributes:
        modules: name in the model -> the dtype each of its own tensors on meta was built in (the init runs in it,
            then each value is cast to the tensor's dtype after the precision plugin, as a whole build would).
    """

    modules: dict[str, dict[str, torch.dtype]]


def defer_dense(model: nn.Module, roots: Sequence[nn.Module] | None = None) -> DeferredDense:
    """The modules of ``roots`` (``None``: all of ``model``) with a parameter on meta, the experts modules excepted:
    left on meta for :func:`materialize_deferred` (pass them to :func:`materialize_dense` as ``exclude``)."""
    found: dict[str, dict[str, torch.dtype]] = {}
    for name, m in _dense_targets(model, roots):
        own = _own_tensors(m)
        if any(isinstance(t, nn.Parameter) and t.is_meta for _, t in own):
            found[name] = {n: t.dtype for n, t in own if t.is_meta}
    return DeferredDense(found)


def materialize_deferred(
    model: nn.Module, deferred: DeferredDense, init: MetaInit, roots: Sequence[nn.Module]
) -> None:
    """Give the deferred modules their values once ``roots`` (the ``fully_shard`` roots) are sharded: every tensor
    still on meta under ``roots`` gets its local storage (a shard's rows; ``fully_shard`` pads them again), then, one
    module at a time in the model's order, its own tensors are built whole in their build dtype, initialised as
    :func:`materialize_dense` would (``module_seed(seed, its name)``), and this rank's part of each copied in. A
    tensor several modules share (tied weights) stays whole until its last owner is initialised."""
    if not deferred.modules:
        return
    for root in roots:
        torch_compat.allocate_meta_tensors(root, init.device)
    modules = {name: model.get_submodule(name) for name in deferred.modules}
    owners: dict[int, int] = {}
    for name, m in modules.items():
        for n, t in _own_tensors(m):
            if n in deferred.modules[name]:
                owners[id(t)] = owners.get(id(t), 0) + 1
    wholes: dict[int, Tensor] = {}
    for name, m in modules.items():
        _fill_module(m, name, deferred.modules[name], init, owners, wholes)


def _fill_module(
    module: nn.Module, name: str, dtypes: dict[str, torch.dtype], init: MetaInit, owners: dict[int, int],
    wholes: dict[int, Tensor],
) -> None:  # fmt: skip
    kept = {n: t for n, t in _own_tensors(module) if n in dtypes}
    for n, t in kept.items():
        whole = wholes.get(id(t))
        if whole is None:
            whole = torch.empty(t.shape, dtype=dtypes[n], device=init.device)
            whole = nn.Parameter(whole, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else whole
        setattr(module, n, whole)
    try:
        init_one_seeded(module, init.seed, name, init.init_module)
    finally:
        built = {n: getattr(module, n) for n in kept}
        for n, t in kept.items():
            setattr(module, n, t)
    for n, t in kept.items():
        owners[id(t)] -= 1
        if owners[id(t)]:
            wholes[id(t)] = built[n]
            continue
        wholes.pop(id(t), None)
        chunk = chunk_of(f"{name}.{n}", t, tuple(t.shape), "`materialize_deferred`")
        box = tuple(slice(o, o + s) for o, s in zip(chunk.offset, chunk.data.shape))
        with torch.no_grad():
            chunk.data.copy_(built[n].detach()[box])


# -- experts -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MetaExperts:
    """An experts module built on meta, found before it is made expert-parallel.

    Attributes:
        name: its name in the unsplit model (its modules' seeds derive from it).
        source: the module itself (on meta: it holds no memory).
        parent, attr: where it sits, so that the module replacing it is found there.
    """

    name: str
    source: nn.Module
    parent: nn.Module
    attr: str


def find_meta_experts(model: nn.Module, roots: Sequence[nn.Module] | None = None) -> list[MetaExperts]:
    """The experts modules of ``roots`` (``None``: ``model``) with tensors on meta, named as in ``model``."""
    names = {id(m): n for n, m in model.named_modules()}
    found = []
    for root in roots if roots is not None else [model]:
        for name, item in find_experts(root).items():
            if any(t.is_meta for t in _tensors(item.module)):
                found.append(MetaExperts(names.get(id(item.module), name), item.module, item.parent, item.attr))
    return found


def materialize_experts(pending: Sequence[MetaExperts], init: MetaInit) -> None:
    """Give each experts module of ``pending`` its values, one layer at a time, once it sits in the model as an
    :class:`ExpertParallelExperts` (or as itself, when it was not made expert-parallel).

    An expert-parallel module gets its local slice allocated; unless ``init.experts_empty``, the layer's full
    experts are allocated and initialised (the seeded values of the unsplit model), the slice copied out and the
    full tensors freed before the next layer. A module left as it is gets all its tensors.
    """
    for item in pending:
        current = getattr(item.parent, item.attr)
        if not isinstance(current, ExpertParallelExperts):
            allocate(list(current.modules()), init.device)
            _init_tree(current, item.name, init)
            continue
        current.to_empty_shards(init.device)
        if init.experts_empty:
            continue
        _fill_slice(current, item, init)


def _fill_slice(ep_module: ExpertParallelExperts, item: MetaExperts, init: MetaInit) -> None:
    source = item.source
    allocate(list(source.modules()), init.device)  # the layer's full experts, transiently
    try:
        _init_tree(source, item.name, init)
        shard = ep_module.expert_shard
        rows = slice(shard.first_expert, shard.first_expert + shard.num_local)
        with torch.no_grad():
            for name, param in ep_module.named_parameters(recurse=False):
                local(param).copy_(getattr(source, name)[rows])
    finally:
        allocate(list(source.modules()), torch.device("meta"))  # freed: the source is no part of the model now


def _init_tree(module: nn.Module, prefix: str, init: MetaInit) -> None:
    for name, sub in module.named_modules():
        if _own_tensors(sub):
            init_one_seeded(sub, init.seed, ".".join(s for s in (prefix, name) if s), init.init_module)


def _dense_targets(model: nn.Module, roots: Sequence[nn.Module] | None) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the modules of ``roots`` with a tensor on meta, the experts modules excepted."""
    roots = [model] if roots is None else roots
    inside = _module_ids(roots)
    experts = _module_ids(m for r in roots for m in _experts_modules(r))
    return [
        (name, m) for name, m in model.named_modules()
        if id(m) in inside and id(m) not in experts and any(t.is_meta for _, t in _own_tensors(m))
    ]  # fmt: skip


# -- primitives --------------------------------------------------------------------------------------------------
def allocate(modules: Sequence[nn.Module], device: torch.device) -> None:
    """Give every own parameter and buffer of ``modules`` that is not on ``device`` an uninitialised tensor there
    (to ``meta``: frees it). A tensor several of ``modules`` share (tied weights) gets one new tensor, shared by all
    of them: pass every owner of a shared tensor together."""
    device = torch.device(device)
    moved: dict[int, Tensor] = {}
    for owner in modules:
        persistent = set(owner.state_dict(keep_vars=True).keys())
        for name, tensor in _own_tensors(owner):
            if tensor.device == device:
                continue
            if id(tensor) not in moved:
                empty = torch.empty_like(tensor, device=device)
                is_param = isinstance(tensor, nn.Parameter)
                moved[id(tensor)] = nn.Parameter(empty, requires_grad=tensor.requires_grad) if is_param else empty
            new = moved[id(tensor)]
            if isinstance(new, nn.Parameter):
                owner.register_parameter(name, new)
            else:
                owner.register_buffer(name, new, persistent=name in persistent)


def _own_tensors(module: nn.Module) -> list[tuple[str, Tensor]]:
    return [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]


def _tensors(module: nn.Module) -> Iterator[Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def _module_ids(roots: Iterator[nn.Module] | Sequence[nn.Module]) -> set[int]:
    return {id(m) for root in roots for m in root.modules()}


def _experts_modules(root: nn.Module) -> list[nn.Module]:
    found = [item.module for item in find_experts(root).values()]
    return found + [m for m in root.modules() if isinstance(m, ExpertParallelExperts)]
