"""The per-rank memory rows of ``check``: the settings a ``fit`` config gives, and :func:`estimate_memory` over a
model built on the meta device (whole at ``pp = 1``, cut into its chunks at ``pp > 1``).

One row per pp rank (at ``pp = 1``, one): the first process of that pp rank (dp rank 0, whose FSDP shard is the
largest; ep ranks hold equal shares of the experts). Pure functions: nothing is allocated, no process group.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightning_moe_overlap.cli.memory.activations import ActivationPolicy, LayerShape, chunk_activations
from lightning_moe_overlap.cli.memory.held import HeldBytes, Layout, held_bytes, tp_sharded_dims
from lightning_moe_overlap.cli.memory.in_flight import peak_bytes, pp1_in_flight
from lightning_moe_overlap.cli.memory.optimizer_state import OptimizerState, optimizer_state
from lightning_moe_overlap.config import OverlapConfig
from lightning_moe_overlap.validation import build_dims, normalize_precision


@dataclass(frozen=True)
class MemorySettings:
    """What the estimate reads from a ``fit`` config besides the strategy's :class:`OverlapConfig`.

    Attributes:
        world_size: processes.
        precision: the Trainer's ``precision`` (``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"``, ...).
        optimizer: the optimizer's class name and hyper-parameters (``None``: read from the model's
            ``configure_optimizers``).
        micro_batch: sequences per micro-batch (the data's ``batch_size / num_microbatches``); None if unknown.
        seq_len: tokens per sequence (the data's ``seq_len``); None if unknown.
        policy: the memory callbacks' recompute and offload.
    """

    world_size: int
    precision: str = "32-true"
    optimizer: tuple[str, dict[str, Any]] | None = None
    micro_batch: int | None = None
    seq_len: int | None = None
    policy: ActivationPolicy = field(default_factory=ActivationPolicy)


@dataclass(frozen=True)
class RankMemory:
    """The memory one process of pp rank ``pp_rank`` needs, in bytes.

    Attributes:
        pp_rank: the pp rank (0 at ``pp = 1``).
        chunks: the pipeline chunks it holds (``(0,)`` at ``pp = 1``).
        held: parameters, gradients and optimizer state (:class:`HeldBytes`).
        activations: the activations at the schedule's peak on the device; None when the sizes are unknown.
        per_microbatch: one micro-batch's activations of all its chunks (device and host), None if unknown.
        in_flight: micro-batches held per chunk at the peak (``{chunk: count}``).
        host_activations: offloaded activations in host memory at that peak.
    """

    pp_rank: int
    chunks: tuple[int, ...]
    held: HeldBytes
    activations: int | None
    per_microbatch: int | None = None
    in_flight: dict[int, int] = field(default_factory=dict)
    host_activations: int = 0

    @property
    def device_total(self) -> int:
        """Everything on the device at the step's peak (activations counted as 0 when unknown)."""
        h = self.held
        return h.params + h.gathered + h.grads + h.optimizer + (self.activations or 0)

    @property
    def host_total(self) -> int:
        """Host memory: the offloaded optimizer state (and its copies) and the offloaded activations."""
        return self.held.host + self.host_activations


def element_bytes(precision: str) -> tuple[int, int]:
    """``(parameter, activation)`` bytes per element of a Lightning ``precision``: ``*-mixed`` keeps float32
    parameters and computes in 16 bits, ``*-true`` keeps both in its dtype."""
    name = normalize_precision(precision)  # "bf16" -> "bf16-mixed", as Lightning reads it
    if name == "64-true":
        return 8, 8
    if name in ("bf16-true", "16-true", "transformer-engine-float16"):
        return 2, 2
    if name in ("bf16-mixed", "16-mixed", "transformer-engine"):
        return 4, 2
    return 4, 4


def model_optimizer(model: nn.Module, settings: MemorySettings) -> tuple[OptimizerState, str | None]:
    """The optimizer's state per parameter: the config's ``optimizer`` section, else the class the model's
    ``configure_optimizers`` returns (called on the meta model). A note when it is unknown."""
    if settings.optimizer is not None:
        name, hparams = settings.optimizer
    else:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                made = model.configure_optimizers()  # type: ignore[operator]
        except Exception as err:  # noqa: BLE001 - a note, never a traceback
            return OptimizerState("?", 0, 0, known=False), f"configure_optimizers failed on meta: {err}"
        opt = _first_optimizer(made)
        if opt is None:
            return OptimizerState("?", 0, 0, known=False), "configure_optimizers returned no optimizer"
        name, hparams = type(opt).__name__, dict(opt.defaults)
    state = optimizer_state(name, hparams)
    note = (
        None
        if state.known
        else (
            f"optimizer {name!r} unknown: its state is counted as 0 (known: Adam, AdamW, SGD, RMSprop, Adagrad, "
            "Adamax, NAdam, RAdam)"
        )
    )
    return state, note


def _first_optimizer(made: Any) -> Any:
    import torch

    if isinstance(made, torch.optim.Optimizer):
        return made
    if isinstance(made, dict):
        return _first_optimizer(made.get("optimizer"))
    if isinstance(made, list | tuple) and made:
        return _first_optimizer(made[0])
    return None


def layer_shape(model: nn.Module, settings: MemorySettings, cfg: OverlapConfig) -> LayerShape | None:
    """The activation sizes of ``model`` (its first MoE block, its embedding, ``MoEGPT``'s hyper-parameters or an
    HF config's ``num_attention_heads``), or None when the data's sizes or the model's are unknown."""
    from lightning_moe_overlap.moe.adapters import find_experts

    if settings.micro_batch is None or settings.seq_len is None:
        return None
    found = list(find_experts(model).values())
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    heads = _hyper(model, "num_heads", "num_attention_heads")
    if not found or not embeddings or heads is None:
        return None
    experts, block = found[0].module, found[0].parent
    e, two_f, d = experts.gate_up_proj.shape  # type: ignore[union-attr]
    top_k = getattr(block, "top_k", None) or getattr(getattr(block, "gate", None), "top_k", None)
    top_k = top_k or _hyper(model, "top_k", "num_experts_per_tok")
    shared = getattr(block, "shared_experts", None) or getattr(block, "shared_expert", None)
    shared_ffn = shared.down_proj.in_features if shared is not None and hasattr(shared, "down_proj") else 0
    fused = bool(getattr(getattr(model, "hparams", {}), "get", lambda *_: False)("fused_cross_entropy", False))
    return LayerShape(
        batch=settings.micro_batch, seq=settings.seq_len // cfg.cp, hidden=int(d), heads=int(heads),
        top_k=int(top_k or 1), ffn=int(two_f) // 2, num_experts=int(e), vocab=max(m.num_embeddings for m in embeddings),
        shared_ffn=shared_ffn, act_bytes=element_bytes(settings.precision)[1], tp=cfg.tp, fused_loss=fused,
    )  # fmt: skip


def _hyper(model: nn.Module, *names: str) -> int | None:
    hparams = getattr(model, "hparams", {}) or {}
    for name in names:
        if name in hparams:
            return int(hparams[name])
    for module in model.modules():
        config = getattr(module, "config", None)
        for name in names:
            if isinstance(getattr(config, name, None), int):
                return int(getattr(config, name))
    return None


def layout_of(cfg: OverlapConfig, settings: MemorySettings) -> Layout:
    """The :class:`Layout` of the config's sizes for ``settings.world_size`` processes."""
    dims = build_dims(cfg, settings.world_size)  # the layout rules' one implementation (dp, edp)
    param_bytes, _ = element_bytes(settings.precision)
    compute = param_bytes
    dtype = getattr(cfg.fsdp_mp_policy, "param_dtype", None)
    if dtype is not None and cfg.shard != "none":
        compute = dtype.itemsize
    return Layout(ep=cfg.ep, tp=cfg.tp, dp_cp=dims.dp * dims.cp, edp=dims.edp, shard=cfg.shard,
                  param_bytes=param_bytes, compute_bytes=compute, offload_fraction=cfg.offload_fraction)  # fmt: skip


def estimate_memory(
    model: nn.Module, cfg: OverlapConfig, settings: MemorySettings, split: Any = None
) -> tuple[list[RankMemory], list[str]]:
    """One :class:`RankMemory` per pp rank, and notes (an unknown optimizer, unknown activation sizes).

    Args:
        model: the model built on the meta device (whole).
        cfg: the strategy's settings.
        settings: what the rest of the config gives (:class:`MemorySettings`).
        split: at ``pp > 1`` the model cut as the strategy will (``pipeline/split.py``'s ``SplitModel``).
    """
    from lightning_moe_overlap.moe.adapters import find_experts

    optimizer, note = model_optimizer(model, settings)
    notes = [note] if note else []
    layout = layout_of(cfg, settings)
    expert_ids = {id(p) for f in find_experts(model).values() for p in f.module.parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    tp_dims = tp_sharded_dims(model, cfg.tp)
    shape = layer_shape(model, settings, cfg)
    if shape is None:
        notes.append("activations unknown: give the data's `seq_len` and `batch_size` and a model with MoE blocks "
                     "and a known number of heads")  # fmt: skip

    def held_of(params: list[nn.Parameter]) -> HeldBytes:
        rows = [(p, id(p) in expert_ids, tp_dims.get(names.get(id(p), ""))) for p in params]
        return held_bytes(rows, layout, optimizer)

    if split is None:
        num_layers = len(find_experts(model))
        held = held_of(list(model.parameters()))
        if shape is None:
            return [RankMemory(0, (0,), held, None)], notes
        one = chunk_activations(shape, num_layers, embedding=True, loss=True, policy=settings.policy)
        layer = chunk_activations(shape, 1, embedding=False, loss=False, policy=settings.policy)
        # overlapped: the backward of i frees as the forward of i+1 allocates (in_flight.py): half a layer more
        extra = layer.device // 2 if pp1_in_flight(cfg.num_microbatches, bool(cfg.overlap)) == 2 else 0
        return [RankMemory(0, (0,), held, one.device + extra, one.device, {0: 1}, one.host + layer.host // 2)], notes
    return _pipeline_rows(split, cfg, shape, settings, held_of), notes


def _pipeline_rows(split: Any, cfg: OverlapConfig, shape: LayerShape | None, settings: MemorySettings,
                   held_of: Any) -> list[RankMemory]:  # fmt: skip
    layout = split.layout
    per_chunk = {}
    if shape is not None:
        for c, chunk in enumerate(layout.chunks):
            per_chunk[c] = chunk_activations(shape, len(chunk.layers), embedding=chunk.embedding, loss=chunk.loss,
                                             policy=settings.policy)  # fmt: skip
    order = None
    if shape is not None:
        from lightning_moe_overlap.pipeline.schedules import compute_order

        order = compute_order(cfg.resolved_schedule, pp=layout.pp, vpp=layout.vpp,
                              num_microbatches=cfg.num_microbatches, overlap=bool(cfg.overlap))  # fmt: skip
    rows = []
    for rank in range(layout.pp):
        chunks = tuple(split.chunk_indices_of_rank(rank))
        params: dict[int, nn.Parameter] = {}
        for c in chunks:
            params.update((id(p), p) for p in split.chunks[c].parameters())
        held = held_of(list(params.values()))
        if order is None:
            rows.append(RankMemory(rank, chunks, held, None))
            continue
        device, at_peak = peak_bytes(order[rank], {c: per_chunk[c].device for c in chunks})
        host = sum(per_chunk[c].host * n for c, n in at_peak.items())
        one = sum(per_chunk[c].device for c in chunks)
        rows.append(RankMemory(rank, chunks, held, device, one, at_peak, host))
    return rows


def settings_from_config(config: dict[str, Any], world_size: int) -> MemorySettings:
    """:class:`MemorySettings` from a parsed ``fit`` config (``check.parse_fit_config``): the Trainer's precision,
    the ``optimizer`` section, the data's ``batch_size`` / ``seq_len`` and the memory callbacks."""
    trainer = config.get("trainer") or {}
    strategy = trainer.get("strategy")
    init = (strategy.get("init_args") or {}) if isinstance(strategy, dict) else {}
    microbatches = int(init.get("num_microbatches") or 1)
    data = ((config.get("data") or {}).get("init_args") or {}) if isinstance(config.get("data"), dict) else {}
    batch, seq = data.get("batch_size"), data.get("seq_len")
    micro = batch // microbatches if isinstance(batch, int) and batch >= microbatches else None
    optimizer = None
    spec = config.get("optimizer")
    if isinstance(spec, dict) and spec.get("class_path"):
        optimizer = (str(spec["class_path"]).rpartition(".")[2], dict(spec.get("init_args") or {}))
    return MemorySettings(
        world_size=world_size, precision=str(trainer.get("precision") or "32-true"), optimizer=optimizer,
        micro_batch=micro, seq_len=seq if isinstance(seq, int) else None, policy=policy_of(trainer.get("callbacks")),
    )  # fmt: skip


def policy_of(callbacks: Any) -> ActivationPolicy:
    """The :class:`ActivationPolicy` of the Trainer's ``SelectiveRecompute`` / ``ActivationOffload`` entries."""
    recompute: tuple[str, ...] = ()
    full: int | None = None
    offload: tuple[str, ...] = ()
    min_bytes = 1 << 20
    for cb in callbacks if isinstance(callbacks, list) else []:
        if not isinstance(cb, dict):
            continue
        kind, args = str(cb.get("class_path", "")).rpartition(".")[2], cb.get("init_args") or {}
        if kind == "SelectiveRecompute":
            if args.get("granularity") == "full":
                block = args.get("method") == "block" and args.get("num_layers") is not None
                full = int(args["num_layers"]) if block else 1 << 30
            else:
                recompute += tuple(args.get("modules") or ())
        elif kind == "ActivationOffload":
            offload += tuple(args.get("modules") or ()) + tuple(args.get("tensors") or ())
            min_bytes = int(args.get("min_tensor_size", min_bytes))
    return ActivationPolicy(recompute, full, offload, min_bytes)
