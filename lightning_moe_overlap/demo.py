"""A small MoE GPT built from this package's layers, and synthetic token data, for the examples and the CLI.

The model code knows nothing about parallelism: the strategy finds its experts and makes them expert-parallel.
At ``pp > 1`` ``MoEGPT`` cuts itself through the public hook (``configure_pipeline`` and ``pipeline_num_layers``,
docs/pipeline.md), its splitter (:func:`split_moegpt`) written here as a user's would be: the library never imports
this module.

Shape legend: B batch, S sequence, D hidden, H heads, V vocabulary.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInput, RowwiseParallel
from torch.utils.data import DataLoader, Dataset

from lightning_moe_overlap.fp8.dense import HIGH_PRECISION_ATTR
from lightning_moe_overlap.loss.fused import DEFAULT_CHUNK_SIZE
from lightning_moe_overlap.loss.vocab_parallel import check_loss_parallel, head_cross_entropy, plain_logits, plain_loss
from lightning_moe_overlap.moe.layer import MoELayer
from lightning_moe_overlap.moe.router import TopKRouter
from lightning_moe_overlap.parallel.context_module import ContextParallel
from lightning_moe_overlap.parallel.tp_styles import vocab_parallel_head
from lightning_moe_overlap.pipeline.batches import token_ids
from lightning_moe_overlap.config.pipeline_layout import Chunk, PipelineLayout
from lightning_moe_overlap.pipeline.split import PipelineChunks, reset_module
from lightning_moe_overlap.pipeline.splitters import check_layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


# Why the fused qkv stays in high precision under `fp8=` at tp > 1 (fp8/dense.py): the FP8 linear is never called.
FUSED_QKV_AT_TP = (
    "fused qkv at tp > 1: each tp rank computes with its heads' rows of the whole weight outside the linear's "
    "forward (`CausalSelfAttention.tp_mesh`), so an FP8 linear would never run"
)


class CausalSelfAttention(nn.Module):
    """Causal multi-head attention with one fused ``qkv`` projection (rows: all queries, all keys, all values).

    ``tp_mesh``: compute only this tp rank's ``H / tp`` heads (:meth:`MoEGPT.tensor_parallel_plan`); the input then
    arrives as a replicated ``DTensor``. The fused weight's rows of one head are not contiguous, so it stays whole on
    every rank and each rank computes with its heads' rows, as a column-wise ``DTensor`` (so the input's gradient is
    summed over tp; the weight's gradient is summed by the strategy, as for every parameter a plan leaves whole);
    ``proj`` is row-wise sharded by the plan.
    """

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.tp_mesh: DeviceMesh | None = None

    def forward(self, x_BSD: Tensor) -> Tensor:
        b, s, d = x_BSD.shape
        head_dim = d // self.num_heads
        if self.tp_mesh is None:
            qkv = self.qkv(x_BSD)
        else:
            per_rank = self.num_heads // self.tp_mesh.size()
            first = self.tp_mesh.get_local_rank() * per_rank
            rows = self.qkv.weight.view(3, self.num_heads, head_dim, d)[:, first : first + per_rank].reshape(-1, d)
            qkv = F.linear(x_BSD, DTensor.from_local(rows, self.tp_mesh, [Shard(0)], run_check=False)).to_local()
        q, k, v = qkv.view(b, s, 3, -1, head_dim).unbind(2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))


class MoEDecoderLayer(nn.Module):
    """Pre-norm attention, then a pre-norm MoE block (the overlap hides its all-to-all)."""

    def __init__(self, hidden_size: int, num_heads: int, moe: MoELayer) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(hidden_size)
        self.attn = CausalSelfAttention(hidden_size, num_heads)
        self.mlp_norm = RMSNorm(hidden_size)
        self.mlp = moe

    def forward(self, x_BSD: Tensor) -> Tensor:
        x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD))
        return x_BSD + self.mlp(self.mlp_norm(x_BSD))


class MoEGPT(LightningModule):
    """A decoder-only language model whose MLPs are mixtures of experts.

    Args:
        vocab_size: Token vocabulary.
        hidden_size: Model width.
        num_layers: Decoder layers.
        num_heads: Attention heads.
        num_experts: Routed experts per MoE layer (the strategy's ``ep`` must divide it).
        top_k: Experts each token is routed to.
        ffn_hidden_size: Hidden size of each expert.
        shared_expert_ffn_hidden_size: Hidden size of the shared expert; None for no shared expert.
        aux_loss_coeff: Weight of the load-balancing loss.
        lr: Learning rate of the optimizer, torch's ``AdamW`` with its defaults otherwise (betas 0.9 / 0.999, weight
            decay 0.01); override ``configure_optimizers`` for another.
        seed: Seed of the parameter initialisation (same model on every rank).
        fused_cross_entropy: Compute the head's projection and the loss together, in blocks, so the ``[B, S, V]``
            logits never exist (:func:`~lightning_moe_overlap.loss.fused_linear_cross_entropy`; Megatron's
            ``--cross-entropy-loss-fusion --cross-entropy-fusion-impl linear``), at ``pp = 1`` (at ``tp > 1`` over
            the vocabulary-parallel head's rows) and on the last pipeline stage. ``forward`` and ``predict_step``
            still return logits.
        cross_entropy_chunk_size: Vocabulary rows (and tokens) per block of the fused loss.

    Attributes:
        context_parallel: ``None``, or at ``cp > 1`` the strategy's handle with which ``_loss`` shards each
            micro-batch's sequences (docs/context_parallel.md).
    """

    context_parallel: ContextParallel | None = None  # set by the strategy at cp > 1

    def __init__(
        self,
        vocab_size: int = 256,
        hidden_size: int = 64,
        num_layers: int = 2,
        num_heads: int = 4,
        num_experts: int = 8,
        top_k: int = 2,
        ffn_hidden_size: int = 128,
        shared_expert_ffn_hidden_size: int | None = None,
        aux_loss_coeff: float = 1e-2,
        lr: float = 3e-3,
        seed: int = 0,
        fused_cross_entropy: bool = False,
        cross_entropy_chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(
            MoEDecoderLayer(
                hidden_size,
                num_heads,
                MoELayer(
                    hidden_size=hidden_size,
                    ffn_hidden_size=ffn_hidden_size,
                    num_experts=num_experts,
                    top_k=top_k,
                    shared_expert_ffn_hidden_size=shared_expert_ffn_hidden_size,
                    aux_loss_coeff=aux_loss_coeff,
                ),
            )
            for _ in range(num_layers)
        )
        self.norm = RMSNorm(hidden_size)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False)
        self.pipeline_num_layers = len(self.layers)  # what the layout places at pp > 1 (configure_pipeline)

    def forward(self, tokens_BS: Tensor, *, logits: bool = True) -> Tensor:
        """``logits_BSV``; with ``logits=False`` the final norm's output ``x_BSD`` (the fused loss's input). At
        ``tp > 1`` the logits are a vocabulary-sharded ``DTensor`` and ``x_BSD`` the rank's ``S / tp`` positions."""
        x_BSD = self.embed(tokens_BS)
        for layer in self.layers:
            x_BSD = layer(x_BSD)
        x_BSD = self.norm(x_BSD)
        return self.head(x_BSD) if logits else x_BSD

    def _loss(self, batch: Any) -> Tensor:
        """Next-token loss of a batch of token ids ``[B, S]`` (a tensor, or a tuple / list holding one, as a
        ``TensorDataset`` loader yields; the same batches as at ``pp > 1``).

        At ``cp > 1`` (``self.context_parallel`` set by the strategy) the inputs and targets, shifted on the whole
        sequence, are sharded for this cp rank and the loss is the mean over the tokens it keeps; the model has no
        position embedding, so the kept tokens' position ids are not needed (causal ring attention orders them)."""
        tokens_BS = token_ids(batch, type(self).__name__)
        inputs_BT, targets_BT = tokens_BS[:, :-1], tokens_BS[:, 1:]
        if self.context_parallel is not None:
            (inputs_BT, targets_BT), _ = self.context_parallel.shard(inputs_BT, targets_BT)
        chunk = self._fused_chunk_size()
        if chunk is not None:
            x_BTD = self(inputs_BT, logits=False)
            return gpt_fused_loss(x_BTD, self.head, targets_BT, chunk)
        return gpt_loss(self(inputs_BT), targets_BT)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return log_loss(self, self._loss(batch))

    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        log_loss(self, self._loss(batch))

    def test_step(self, batch: Tensor, batch_idx: int) -> None:
        log_loss(self, self._loss(batch))

    def predict_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        """The most likely next token after each position: ``[B, S]`` token ids."""
        return plain_logits(self(token_ids(batch, type(self).__name__))).argmax(dim=-1)

    def init_module(self, module: nn.Module) -> None:
        """The initialisation of one module (:func:`gpt_init_module`): the strategy's hook for a model built on the
        meta device (docs/index.md, "Built on the meta device")."""
        gpt_init_module(module)

    def tensor_parallel_plan(self, tp_mesh: DeviceMesh) -> dict[str, ParallelStyle]:
        """The plan at ``tp > 1`` (docs/tensor_parallel.md), torch's styles with sequence parallelism: the embedding
        vocabulary-parallel, cut onto the sequence; each attention gathers its input, computes its heads and
        reduce-scatters onto the sequence; norms and MoE blocks run on the rank's tokens; the head gathers its input
        and keeps its logits vocabulary-sharded (a ``Shard(-1)`` ``DTensor``: the loss runs over the shards under
        ``loss_parallel``, entered by the strategy)."""
        tp = tp_mesh.size()
        hidden, heads = self.hparams.hidden_size, self.hparams.num_heads
        if heads % tp or hidden % tp:
            raise ValueError(
                f"`MoEGPT`: num_heads={heads}, hidden_size={hidden} with tp={tp}: each tp rank computes heads / tp "
                "heads, so tp must divide both. Choose tp among their common divisors."
            )
        for layer in self.layers:
            layer.attn.tp_mesh = tp_mesh
            setattr(layer.attn.qkv, HIGH_PRECISION_ATTR, FUSED_QKV_AT_TP)
        return {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "layers.*.attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "layers.*.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            "head": vocab_parallel_head(),
        }

    def configure_pipeline(self, layout: PipelineLayout) -> PipelineChunks:
        """The pipeline chunks at ``pp > 1`` (docs/pipeline.md): :func:`split_moegpt`, its loss logged as
        ``training_step`` / ``validation_step`` log it (on the last stage; the strategy replays it on every rank)."""
        return with_logged_loss(self, split_moegpt(self, layout, fused_chunk_size=self._fused_chunk_size()))

    def _fused_chunk_size(self) -> int | None:
        """The fused loss's block size, None without it (a subclass that saves other hyperparameters: None)."""
        if not self.hparams.get("fused_cross_entropy", False):
            return None
        return self.hparams.get("cross_entropy_chunk_size", DEFAULT_CHUNK_SIZE)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def log_loss(module: LightningModule, loss: Tensor) -> Tensor:
    """Log ``train_loss`` while training, ``val_loss`` while validating, ``test_loss`` while testing (when a Trainer
    runs ``module``)."""
    try:
        trainer = module.trainer
    except RuntimeError:  # not attached to a Trainer (the model used on its own)
        return loss
    if trainer.training:
        module.log("train_loss", loss, prog_bar=True)
    elif trainer.validating or trainer.sanity_checking:
        module.log("val_loss", loss, sync_dist=True)
    elif trainer.testing:
        module.log("test_loss", loss, sync_dist=True)
    return loss


def with_logged_loss(module: LightningModule, chunks: PipelineChunks) -> PipelineChunks:
    """``chunks`` whose loss function logs like :func:`log_loss` (the demos' ``configure_pipeline``)."""
    loss_fn = chunks.loss_fn
    return replace(chunks, loss_fn=lambda output, target: log_loss(module, loss_fn(output, target)))


# -- MoEGPT's pipeline chunks (its configure_pipeline at pp > 1) -----------------------------------------------
class GPTChunk(nn.Module):
    """A run of ``MoEGPT`` layers; with ``embed`` it takes tokens, with ``head`` it returns logits (with
    ``project=False`` the final norm's output: the fused loss applies the head it holds)."""

    def __init__(self, embed: nn.Module | None, layers: dict[int, nn.Module], norm: nn.Module | None,
                 head: nn.Module | None, *, project: bool = True) -> None:
        super().__init__()
        self.embed = embed
        self.layers = nn.ModuleDict({str(i): layer for i, layer in layers.items()})
        self.norm = norm
        self.head = head
        self.project = project

    def forward(self, x: Tensor) -> Tensor:  # tokens_BS (chunk 0) or x_BSD
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.head is not None:
            x = self.norm(x)  # x_BSD
            if self.project:
                x = self.head(x)  # logits_BSV
        return x


def gpt_loss(logits_BSV: Tensor, target_BS: Tensor) -> Tensor:
    """``MoEGPT``'s next-token loss (as in its ``training_step``), a plain scalar. At ``tp > 1`` the logits are a
    vocabulary-sharded ``DTensor`` and the cross-entropy runs over the shards (``loss_parallel``, entered by the
    strategy)."""
    check_loss_parallel(logits_BSV, "the logits", "MoEGPT")
    loss = F.cross_entropy(logits_BSV.reshape(-1, logits_BSV.shape[-1]).float(), target_BS.reshape(-1))
    return plain_loss(loss)


def gpt_fused_loss(x_BSD: Tensor, head: nn.Module, target_BS: Tensor, chunk_size: int) -> Tensor:
    """``gpt_loss(head(x_BSD), target_BS)`` without the logits (:func:`head_cross_entropy`: the fused loss, over the
    vocabulary-parallel head's rows at ``tp > 1``)."""
    return head_cross_entropy(x_BSD, head.weight, target_BS, bias=head.bias, chunk_size=chunk_size,
                              where="MoEGPT(fused_cross_entropy=True)")  # fmt: skip


def gpt_prepare_batch(batch: Any) -> tuple[tuple[Tensor, ...], Tensor]:
    """``tokens_BS`` (or a tuple / list holding it) -> inputs ``tokens[:, :-1]``, targets ``tokens[:, 1:]``."""
    tokens_BS = token_ids(batch, "MoEGPT")
    return (tokens_BS[:, :-1],), tokens_BS[:, 1:]


def gpt_init_module(module: nn.Module) -> None:
    """``MoEGPT``'s initialisation of one module (norms to one, routers N(0, 0.02), the rest reset)."""
    if isinstance(module, RMSNorm):
        nn.init.ones_(module.weight)
    elif isinstance(module, TopKRouter):
        nn.init.normal_(module.weight, std=0.02)
        for buffer in module.buffers(recurse=False):
            buffer.zero_()
    else:
        reset_module(module)


def split_moegpt(model: nn.Module, layout: PipelineLayout, *, fused_chunk_size: int | None = None) -> PipelineChunks:
    """``MoEGPT``: embedding with chunk 0, final norm + head with the last chunk, layers per the layout.

    ``fused_chunk_size``: the last chunk returns the final norm's output and the loss is :func:`gpt_fused_loss`
    with the head that chunk holds, in blocks of that size (``MoEGPT(fused_cross_entropy=True)``); None: logits
    and :func:`gpt_loss`. At ``cp > 1`` each cp rank's micro-batches hold its tokens of every sequence and the loss is
    the mean over them (equal counts on every cp rank: the gradients' mean over dp x cp is the whole sequence's)."""
    check_layers(model, layout, len(model.layers))
    project = fused_chunk_size is None

    def prepare_batch(batch: Any) -> tuple[tuple[Tensor, ...], Tensor]:
        """:func:`gpt_prepare_batch`; at ``cp > 1`` (``model.context_parallel``, set by the strategy after the cut)
        the inputs and targets, shifted on the whole sequence, sharded for this cp rank as ``MoEGPT._loss`` does."""
        (inputs_BT,), targets_BT = gpt_prepare_batch(batch)
        cp: ContextParallel | None = getattr(model, "context_parallel", None)
        if cp is not None:
            (inputs_BT, targets_BT), _ = cp.shard(inputs_BT, targets_BT)
        return (inputs_BT,), targets_BT

    def chunk(c: Chunk) -> GPTChunk:
        return GPTChunk(
            model.embed if c.embedding else None, {i: model.layers[i] for i in c.layers},
            model.norm if c.loss else None, model.head if c.loss else None, project=project,
        )

    chunks = [chunk(c) for c in layout.chunks]
    if project:
        return PipelineChunks(chunks, gpt_loss, prepare_batch, gpt_init_module, cp_sharded=True)
    last = chunks[-1]  # its head's weight read at each call: the one the strategy has put in place by then

    def loss_fn(x_BSD: Tensor, target_BS: Tensor) -> Tensor:
        return gpt_fused_loss(x_BSD, last.head, target_BS, fused_chunk_size)

    return PipelineChunks(chunks, loss_fn, prepare_batch, gpt_init_module, cp_sharded=True)


class _PatternTokens(Dataset):
    """Sequences that follow ``t[i+1] = (a * t[i] + c) % V`` with a per-sequence ``a, c``: learnable, deterministic."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab_size, (num_samples,), generator=g)
        a = torch.randint(1, 4, (num_samples,), generator=g)
        c = torch.randint(0, vocab_size, (num_samples,), generator=g)
        seq = [start]
        for _ in range(seq_len):
            seq.append((a * seq[-1] + c) % vocab_size)
        self.tokens = torch.stack(seq, dim=1)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> Tensor:
        return self.tokens[i]


class SyntheticTokens(LightningDataModule):
    """Deterministic synthetic token sequences (no download).

    Args:
        vocab_size: Token vocabulary; match the model's.
        seq_len: Tokens per sample (plus one for the shifted target).
        batch_size: Samples per batch on each data-parallel rank (a multiple of the strategy's micro-batches).
        num_samples: Training samples.
        seed: Data seed.
    """

    def __init__(
        self, vocab_size: int = 256, seq_len: int = 64, batch_size: int = 8, num_samples: int = 2048, seed: int = 0
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader:
        h = self.hparams
        data = _PatternTokens(h.num_samples, h.seq_len, h.vocab_size, h.seed)
        return DataLoader(data, batch_size=h.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return self._held_out(seed_offset=1)

    def test_dataloader(self) -> DataLoader:
        return self._held_out(seed_offset=2)

    def predict_dataloader(self) -> DataLoader:
        return self._held_out(seed_offset=3)

    def _held_out(self, seed_offset: int) -> DataLoader:
        h = self.hparams
        data = _PatternTokens(max(h.batch_size * 4, 32), h.seq_len, h.vocab_size, h.seed + seed_offset)
        return DataLoader(data, batch_size=h.batch_size, drop_last=True)
