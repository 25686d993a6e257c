"""Cut a model into pipeline chunks, each rank materialising only its own.

Flow (docs/pipeline.md, "Splitting the model")::

    with torch.device("meta"):
        model = MyModel(...)                                   # no memory
    split = split_model(model, build_layout(num_layers, pp=2, vpp=2))
    split.materialize(split.chunk_indices_of_rank(pp_rank), device, seed=0)   # or state_dict=...

Who cuts the model, first match wins:

1. ``split_model(..., splitter=fn)``: ``fn(model, layout) -> PipelineChunks``;
2. the model's own hook, ``model.configure_pipeline(layout) -> PipelineChunks`` (:class:`PipelineSplittable`);
3. the built-in splitter (``pipeline/splitters.py``): Hugging Face transformers v5 decoder LMs
   (``model.model.layers``), also when they sit in a LightningModule's ``model`` attribute. (This package's demo
   ``MoEGPT`` cuts itself, through 2.)

Chunks are built from the model's own submodules, so a chunk's names map onto the unsplit model's names (found by
module identity, kept as prefixes): checkpoints stay keyed by the unsplit model's names at any pp.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_moe_overlap.pipeline.chunks import (
    ChunkKwargs,
    InitModule,
    LossFn,
    PipelineChunks,
    PipelineSplittable,
    PrepareBatch,
    Splitter,
)
from lightning_moe_overlap.config.pipeline_layout import PipelineLayout


@dataclass
class SplitModel:
    """A model cut into chunks. Build it with :func:`split_model`.

    Attributes:
        model: the unsplit model (usually on the meta device); chunks share its submodules.
        layout: the chunks' layers and ranks.
        chunks: one module per chunk, in model order.
        loss_fn, prepare_batch, init_module, chunk_kwargs, token_loss, cp_sharded: from :class:`PipelineChunks`.
        module_names: per chunk, chunk module path -> unsplit module path (the top-most shared modules).
    """

    model: nn.Module
    layout: PipelineLayout
    chunks: tuple[nn.Module, ...]
    loss_fn: LossFn
    prepare_batch: PrepareBatch
    init_module: InitModule | None
    module_names: tuple[dict[str, str], ...] = field(repr=False)
    chunk_kwargs: ChunkKwargs | None = None
    token_loss: bool = False
    cp_sharded: bool = False

    def chunk_indices_of_rank(self, rank: int) -> list[int]:
        return [c.index for c in self.layout.chunks_of_rank(rank)]

    def fqn(self, chunk: int, name: str) -> str:
        """The unsplit model's name of chunk ``chunk``'s parameter / buffer / module ``name``."""
        return _translate(self.module_names[chunk], name, chunk)

    def name_map(self, chunk: int) -> dict[str, str]:
        """Chunk state-dict key -> unsplit model state-dict key."""
        return {k: self.fqn(chunk, k) for k in self.chunks[chunk].state_dict(keep_vars=True)}

    def unsplit_state_dict(self, chunks: Iterable[int]) -> dict[str, Tensor]:
        """The state of ``chunks`` keyed by the unsplit model's names (what a checkpoint stores)."""
        out: dict[str, Tensor] = {}
        for c in chunks:
            out.update({self.fqn(c, k): v for k, v in self.chunks[c].state_dict().items()})
        return out

    def step_inputs(self, batch: Any) -> tuple[tuple[Tensor, ...], Tensor, dict[str, Tensor]]:
        """``batch`` as one step takes it: the first chunk's inputs and the loss target (``prepare_batch``), and the
        keyword tensors of every chunk (``chunk_kwargs``). Raises ``TypeError`` when they are not tensors."""
        prepared = self.prepare_batch(batch)
        kwargs = dict(self.chunk_kwargs(batch)) if self.chunk_kwargs is not None else {}
        args, target = prepared if isinstance(prepared, tuple) and len(prepared) == 2 else (None, None)
        if (
            not isinstance(args, (tuple, list))
            or not all(isinstance(a, Tensor) for a in args)
            or not isinstance(target, Tensor)
            or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in kwargs.items())
        ):
            raise TypeError(
                f"The pipeline split of {type(self.model).__name__}: prepare_batch returned "
                f"{_kinds(prepared)} and chunk_kwargs {_kinds(kwargs)}. Rule: prepare_batch(batch) returns (a tuple "
                "of tensors, the first chunk's inputs; a tensor, the loss target) and chunk_kwargs(batch) a dict "
                "of tensors. Fix: return tensors from both (configure_pipeline's PipelineChunks)."
            )
        return tuple(args), target, kwargs

    def parameter_counts(self) -> list[int]:
        """Parameters (elements) per chunk, materialised or not."""
        return [sum(p.numel() for p in m.parameters()) for m in self.chunks]

    def materialize(
        self,
        chunks: Iterable[int],
        device: torch.device | str,
        *,
        state_dict: Mapping[str, Tensor] | None = None,
        seed: int = 0,
    ) -> None:
        """Allocate chunks ``chunks`` on ``device`` and fill them; the other chunks stay as they are (meta).

        Every module is first initialised with ``init_module`` under a seed derived from ``seed`` and its unsplit
        name (:func:`seeded_init`), so the values equal those of ``seeded_init(unsplit_model, seed, ...)`` and
        buffers outside the state dict (e.g. rotary frequencies) are computed. Then ``state_dict`` (keyed by the
        unsplit model's names; full or holding at least these chunks' keys) overwrites parameters and buffers.
        """
        for c in chunks:
            module = self.chunks[c]
            module.to_empty(device=device)
            seeded_init(module, seed, self.init_module, fqn=lambda name, c=c: self._init_name(c, name))
            if state_dict is not None:
                self._load(c, state_dict)

    def _init_name(self, chunk: int, name: str) -> str:
        try:
            return self.fqn(chunk, name)
        except KeyError:  # a module the splitter created (stateless, e.g. a rotary embedding): a chunk-local name
            return f"<chunk {chunk}>.{name}"

    def _load(self, chunk: int, state_dict: Mapping[str, Tensor]) -> None:
        names = self.name_map(chunk)
        missing = sorted(fqn for fqn in names.values() if fqn not in state_dict)
        if missing:
            raise KeyError(
                f"SplitModel.materialize: the state dict lacks {len(missing)} key(s) of chunk {chunk}, e.g. "
                f"{missing[:3]}. Rule: it is keyed by the unsplit model's names and holds every key of the chunks "
                "being materialised. Fix: pass the unsplit model's state_dict() (or a checkpoint of it)."
            )
        local = {k: state_dict[fqn] for k, fqn in names.items()}
        self.chunks[chunk].load_state_dict(local, strict=True)


def split_model(model: nn.Module, layout: PipelineLayout, *, splitter: Splitter | None = None) -> SplitModel:
    """Cut ``model`` into ``layout.num_chunks`` chunks (see the module docstring for who cuts it)."""
    if splitter is not None:
        result = splitter(model, layout)
    elif isinstance(model, PipelineSplittable):
        result = model.configure_pipeline(layout)
    else:
        from lightning_moe_overlap.pipeline.splitters import builtin_splitter

        result = builtin_splitter(model)(model, layout)
    if not isinstance(result, PipelineChunks):
        raise TypeError(
            f"split_model: the splitter of {type(model).__name__} returned {type(result).__name__}. Rule: a "
            "splitter returns PipelineChunks(modules, loss_fn, prepare_batch). Fix: wrap the chunk modules in "
            "PipelineChunks."
        )
    chunks = tuple(result.modules)
    if len(chunks) != layout.num_chunks:
        raise ValueError(
            f"split_model: the splitter of {type(model).__name__} returned {len(chunks)} chunk modules for a layout "
            f"of pp * vpp = {layout.pp} * {layout.vpp} = {layout.num_chunks} chunks. Rule: one module per chunk. "
            "Fix: return one module per entry of layout.chunks."
        )
    names = tuple(_module_names(model, chunk) for chunk in chunks)
    split = SplitModel(
        model, layout, chunks, result.loss_fn, result.prepare_batch, result.init_module, module_names=names,
        chunk_kwargs=result.chunk_kwargs, token_loss=result.token_loss, cp_sharded=result.cp_sharded,
    )
    _check_cover(split)
    return split


# -- names -----------------------------------------------------------------------------------------------------
def _module_names(model: nn.Module, chunk: nn.Module) -> dict[str, str]:
    """Chunk module path -> model module path, for the top-most chunk modules that are the model's own."""
    in_model = {id(m): n for n, m in model.named_modules()}
    out: dict[str, str] = {}
    for name, module in chunk.named_modules():
        if id(module) in in_model and not any(name.startswith(p + ".") or p == "" for p in out):
            out[name] = in_model[id(module)]
    return out


def _translate(prefixes: Mapping[str, str], name: str, chunk: int) -> str:
    best = max((p for p in prefixes if p == "" or name == p or name.startswith(p + ".")), key=len, default=None)
    if best is None:
        raise KeyError(
            f"chunk {chunk}'s {name!r} is not part of the unsplit model. Rule: chunks are built from the model's own "
            "modules, so every name maps onto the model's. Fix: take the module from the model instead of "
            "creating it in the splitter (modules without state, e.g. a rotary embedding, may be created)."
        )
    rest = name[len(best) :].lstrip(".")
    return ".".join(s for s in (prefixes[best], rest) if s)


def _check_cover(split: SplitModel) -> None:
    """Every chunk key is a model key; every model parameter is in exactly one chunk."""
    model_keys = set(split.model.state_dict(keep_vars=True))
    model_name: dict[int, str] = {}
    for name, p in split.model.named_parameters(remove_duplicate=False):
        model_name.setdefault(id(p), name)
    holder: dict[int, int] = {}
    for c, chunk in enumerate(split.chunks):
        for key, fqn in split.name_map(c).items():
            if fqn not in model_keys:
                raise KeyError(
                    f"split_model: chunk {c}'s {key!r} maps to {fqn!r}, which is not a key of the unsplit model's "
                    "state dict. Rule: chunk names map onto the model's. Fix: build chunks from the model's modules."
                )
        for name, p in chunk.named_parameters():
            first = holder.setdefault(id(p), c)
            if first != c:
                raise NotImplementedError(
                    f"split_model: parameter {model_name.get(id(p), name)!r} is in chunk {first} and chunk {c} "
                    "(tied weights, e.g. tie_word_embeddings=True). Rule: each parameter lives in one chunk. Fix: "
                    "untie the weights (tie_word_embeddings=False) or keep them in one chunk."
                )
    unheld = sorted(name for pid, name in model_name.items() if pid not in holder)
    if unheld:
        raise ValueError(
            f"split_model: {len(unheld)} parameter(s) of the unsplit model are in no chunk, e.g. {unheld[:3]}. "
            "Rule: every parameter is trained by some chunk. Fix: include those modules in a chunk."
        )


# -- initialisation --------------------------------------------------------------------------------------------
def module_seed(seed: int, fqn: str) -> int:
    """A seed for the module named ``fqn`` (same on every process, unlike ``hash``)."""
    digest = hashlib.sha256(f"{seed}:{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seeded_init(
    module: nn.Module, seed: int, init_module: InitModule | None, *, fqn: Callable[[str], str] = lambda n: n
) -> None:
    """Initialise each submodule of ``module`` with ``init_module`` under ``module_seed(seed, fqn(its name))``.

    Applied to the unsplit model (``fqn`` the identity) and to its chunks (``fqn`` the name map), it gives equal
    values: each module's random stream depends on its unsplit name only, not on what else was built before it.
    """
    init = init_module or reset_module
    for name, sub in module.named_modules():
        if _own_tensors(sub):
            init_one_seeded(sub, seed, fqn(name), init)


def init_one_seeded(module: nn.Module, seed: int, fqn: str, init_module: InitModule) -> None:
    """``init_module(module)`` under ``module_seed(seed, fqn)``: how :func:`seeded_init` initialises each module
    (``fqn`` its unsplit name), the global random state left as it was."""
    devices = [t.device for _, t in _own_tensors(module)]
    cuda = sorted({d.index or 0 for d in devices if d.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(module_seed(seed, fqn))
        with torch.no_grad():
            init_module(module)


def reset_module(module: nn.Module) -> None:
    """The default ``init_module``: ``module.reset_parameters()``; an error for a module with parameters without it."""
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    elif any(True for _ in module.parameters(recurse=False)):
        raise TypeError(
            f"seeded_init: {type(module).__name__} has parameters and no reset_parameters(). Rule: without an "
            "init_module every module with parameters resets itself. Fix: define `init_module(self, module)` on the "
            "LightningModule (it initialises one module's own tensors; used for a model built on the meta device at "
            "every pp), or give PipelineChunks an init_module, or materialize from a state_dict."
        )


def _own_tensors(module: nn.Module) -> list[tuple[str, Tensor]]:
    return [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]



def _kinds(value: Any) -> str:
    """A short picture of a nested value's types, for error messages: ``(tuple[Tensor], Tensor)``."""
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {_kinds(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}[" + ", ".join(_kinds(v) for v in value) + "]"
    return type(value).__name__
