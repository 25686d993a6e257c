"""What autograd saves for backward in one micro-batch, counted from the model's sizes (``demo.py``'s ``MoEGPT``
layer, read tensor by tensor; a Hugging Face layer is counted as the same layer with its sizes).

Per decoder layer, with ``T`` the tokens of a micro-batch on this rank, ``A = T * K`` the (token, expert) pairs its
experts receive (balanced routing: each rank receives as many as it sends), ``p`` the activations' bytes per
element and ``H`` the heads (``h`` the head size):

==================== ================================================== ===================================
region               saved tensor                                       bytes
==================== ================================================== ===================================
``attn_norm``        input, ``rsqrt``, ``weight * x``                   ``(2 T D + T) p``
``attn`` (qkv)       the norm's output (the qkv projection's input)     ``T D p``
``core_attn``        q, k, v (one storage), the output, logsumexp       ``4 T D p + T H 4``
``mlp_norm``         input, ``rsqrt``, ``weight * x``                   ``(2 T D + T) p``
router               its input; logits, probabilities, indices          ``T D p + 8 T E + 28 T K + 8 E``
routed experts       order, dispatched input, fc1 output, activation,  ``A (2 D p + 4 F p + 28)``
                     its product with up, the experts' output, weights
shared experts       fc1 output, activation, product                   ``4 T F_s p``
==================== ================================================== ===================================

The embedding chunk adds the token ids (``8 T``), the loss chunk the final norm, the head's input and the float32
log-probabilities (``(3 T D + T) p + 4 T V / tp + 8 T``; none with the fused loss). The attention kernel is the
flash / memory-efficient one (no ``S x S`` matrix). Under tensor parallelism the norms, the router and the experts
see ``T / tp`` tokens (sequence parallelism), the attention ``H / tp`` heads of the whole sequence; under context
parallelism every count is of the ``S / cp`` tokens of this rank.

Recompute (``SelectiveRecompute``) drops what a recomputed region saves and keeps its input; activation offload
(``ActivationOffload``) moves what a region saves, or a named tensor, to the host when it is at least
``min_tensor_size`` bytes. Left out: autocast's low-precision weight copies under ``*-mixed`` precision, the
dispatchers' communication buffers, routing imbalance, and the transient buffers of a backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LayerShape:
    """The sizes that set one micro-batch's activations on this rank.

    Attributes:
        batch: sequences per micro-batch.
        seq: tokens per sequence on this rank (``S / cp``).
        hidden: ``D``.
        heads: attention heads ``H``.
        top_k: ``K``.
        ffn: routed experts' ffn size ``F``.
        num_experts: ``E``.
        vocab: ``V``.
        shared_ffn: shared experts' ffn size (0: none).
        act_bytes: bytes per activation element (4 in fp32, 2 under bf16 / fp16).
        tp: tensor parallelism (sequence-parallel regions hold ``T / tp`` tokens).
        fused_loss: the loss is fused with the head (no logits).
    """

    batch: int
    seq: int
    hidden: int
    heads: int
    top_k: int
    ffn: int
    num_experts: int
    vocab: int
    shared_ffn: int = 0
    act_bytes: int = 4
    tp: int = 1
    fused_loss: bool = False

    @property
    def tokens(self) -> int:
        """``T``: the micro-batch's tokens on this rank's sequence-parallel regions."""
        return self.batch * self.seq // self.tp


@dataclass(frozen=True)
class Saved:
    """One tensor (or one storage of several) a layer saves: the regions it belongs to and its bytes."""

    regions: tuple[str, ...]
    nbytes: int


@dataclass(frozen=True)
class ActivationPolicy:
    """What the memory callbacks do to the saved tensors.

    Attributes:
        recompute: ``SelectiveRecompute(modules=...)`` names.
        full_layers: with ``granularity="full"``: how many layers (of the chunk, from its first) keep only their
            input; None without it.
        offload: ``ActivationOffload`` module and tensor names.
        offload_min_bytes: its ``min_tensor_size``.
    """

    recompute: tuple[str, ...] = ()
    full_layers: int | None = None
    offload: tuple[str, ...] = ()
    offload_min_bytes: int = 1 << 20


# region of a saved tensor -> the recompute names that drop it (the region's own input is kept: counted elsewhere)
_DROPPED_BY: dict[str, tuple[str, ...]] = {
    "attn_norm.inner": ("layernorm", "a2a_overlap_attn"),
    "qkv_in": ("a2a_overlap_attn",),
    "core_attn.lse": ("core_attn", "a2a_overlap_attn"),
    "core_attn.qkv": ("a2a_overlap_attn",),
    "core_attn.out": ("a2a_overlap_attn",),
    "mlp_norm.inner": ("layernorm", "a2a_overlap_post_attn"),
    "router.input": ("a2a_overlap_post_attn", "moe", "mlp"),
    "router.small": ("a2a_overlap_post_attn", "moe", "mlp"),
    "experts.small": ("routed_experts", "moe", "mlp"),
    "experts.dispatched": ("routed_experts", "moe", "mlp"),
    "experts.fc1": ("a2a_overlap_mlp", "routed_experts", "moe", "mlp"),
    "experts.act": ("moe_act", "a2a_overlap_mlp", "routed_experts", "moe", "mlp"),
    "experts.product": ("a2a_overlap_mlp", "routed_experts", "moe", "mlp"),
    "experts.out": ("routed_experts", "moe", "mlp"),
    "shared": ("shared_experts", "moe", "mlp"),
}
# offload names -> the regions whose saved tensors they move to the host
_OFFLOADED_BY: dict[str, tuple[str, ...]] = {
    "attn_norm": ("attn_norm.input", "attn_norm.inner"),
    "core_attn": ("core_attn.qkv", "core_attn.out", "core_attn.lse"),
    "attn_proj": (),  # its input is the core attention's output, counted there
    "mlp_norm": ("mlp_norm.input", "mlp_norm.inner"),
    "expert_fc1": ("experts.dispatched",),
    "dispatched_input": ("experts.dispatched",),
    "moe_act": ("experts.fc1",),
    "pre_mlp_layernorm_output": ("router.input",),
}


def layer_saved(shape: LayerShape) -> list[Saved]:
    """The tensors one decoder layer saves for backward (module docstring's table)."""
    t, d, p = shape.tokens, shape.hidden, shape.act_bytes
    full_t = shape.batch * shape.seq  # the attention's tokens (the whole sequence, H / tp heads)
    a = t * shape.top_k
    attn_share = full_t * d * p // shape.tp
    out = [
        Saved(("attn_norm.input",), t * d * p),
        Saved(("attn_norm.inner",), t * d * p + t * p),
        Saved(("qkv_in",), full_t * d * p),
        Saved(("core_attn.qkv",), 3 * attn_share),
        Saved(("core_attn.out",), attn_share),
        Saved(("core_attn.lse",), full_t * (shape.heads // shape.tp) * 4),
        Saved(("mlp_norm.input",), t * d * p),
        Saved(("mlp_norm.inner",), t * d * p + t * p),
        Saved(("router.input",), t * d * p),
        Saved(("router.small",), 8 * t * shape.num_experts + 28 * t * shape.top_k + 8 * shape.num_experts),
        Saved(("experts.small",), 28 * a),
        Saved(("experts.dispatched",), a * d * p),
        Saved(("experts.fc1",), 2 * a * shape.ffn * p),
        Saved(("experts.act",), a * shape.ffn * p),
        Saved(("experts.product",), a * shape.ffn * p),
        Saved(("experts.out",), a * d * p),
    ]
    if shape.shared_ffn:
        out.append(Saved(("shared",), 4 * t * shape.shared_ffn * p))
    return out


def ends_saved(shape: LayerShape, *, embedding: bool, loss: bool) -> list[Saved]:
    """What the chunk's ends save: the token ids (``embedding``); the final norm, the head's input and the
    log-probabilities (``loss``)."""
    t, d, p = shape.tokens, shape.hidden, shape.act_bytes
    out = [Saved(("embedding",), 8 * t)] if embedding else []
    if loss:
        out += [Saved(("final_norm",), 2 * t * d * p + t * p), Saved(("head",), shape.batch * shape.seq * d * p)]
        if not shape.fused_loss:
            out.append(Saved(("loss",), 4 * shape.batch * shape.seq * shape.vocab // shape.tp + 8 * t))
    return out


@dataclass(frozen=True)
class ChunkActivations:
    """One micro-batch's activations of one chunk (bytes): kept on the device, and moved to the host."""

    device: int
    host: int = 0
    regions: dict[str, int] = field(default_factory=dict)


def chunk_activations(
    shape: LayerShape, num_layers: int, *, embedding: bool, loss: bool, policy: ActivationPolicy = ActivationPolicy()
) -> ChunkActivations:
    """One micro-batch's saved bytes of a chunk of ``num_layers`` layers (with the embedding / the loss), after
    ``policy``'s recompute and offload."""
    device = host = 0
    regions: dict[str, int] = {}
    for index in range(num_layers):
        full = policy.full_layers is not None and index < policy.full_layers
        for saved in _after_policy(layer_saved(shape), policy, full=full, input_bytes=shape.tokens * shape.hidden
                                   * shape.act_bytes):  # fmt: skip
            dev, off = _placed(saved, policy)
            device, host = device + dev, host + off
            regions[saved.regions[0]] = regions.get(saved.regions[0], 0) + saved.nbytes
    for saved in ends_saved(shape, embedding=embedding, loss=loss):
        device += saved.nbytes
        regions[saved.regions[0]] = regions.get(saved.regions[0], 0) + saved.nbytes
    return ChunkActivations(device, host, regions)


def _after_policy(saved: Sequence[Saved], policy: ActivationPolicy, *, full: bool, input_bytes: int) -> list[Saved]:
    if full:  # a recomputed layer keeps its input only
        return [Saved(("layer_input",), input_bytes)]
    dropped = set(policy.recompute)
    return [s for s in saved if not any(name in dropped for r in s.regions for name in _DROPPED_BY.get(r, ()))]


def _placed(saved: Saved, policy: ActivationPolicy) -> tuple[int, int]:
    """``(device, host)`` bytes of ``saved`` under the offload names."""
    moved = {r for name in policy.offload for r in _OFFLOADED_BY.get(name, ())}
    if moved & set(saved.regions) and saved.nbytes >= policy.offload_min_bytes:
        return 0, saved.nbytes
    return saved.nbytes, 0
