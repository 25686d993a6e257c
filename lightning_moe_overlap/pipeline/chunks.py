"""What a splitter returns: the chunk modules and the functions that run them (:class:`PipelineChunks`).

Its own module so that the splitters (``splitters.py``, a model's ``configure_pipeline``) and the code that cuts a
model with them (``split.py``) both import it without importing each other; ``split.py`` re-exports every name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn

from lightning_moe_overlap.config.pipeline_layout import PipelineLayout

SEQUENCE_SHARDS_ATTR = "sequence_shards"
"""A chunk module's optional int attribute: how many parts the sequence between decoder layers is cut into (the
strategy sets it to ``tp`` at ``tp > 1``: sequence parallelism leaves each tp rank ``S / tp`` positions of the
residual stream). A chunk that rebuilds per-position tensors from its input's length (position ids, the causal mask)
declares it, so that it builds them for the whole sequence when its input comes from an earlier chunk's layers."""

LossFn = Callable[[Tensor, Tensor], Tensor]
PrepareBatch = Callable[[Any], tuple[tuple[Tensor, ...], Tensor]]
InitModule = Callable[[nn.Module], None]
ChunkKwargs = Callable[[Any], Mapping[str, Tensor]]


@dataclass
class PipelineChunks:
    """What a splitter (or a model's ``configure_pipeline``) returns.

    Attributes:
        modules: one ``nn.Module`` per chunk, in model order (``layout.num_chunks`` of them), built from the model's
            own submodules. Chunk ``c``'s ``forward`` takes the tensors chunk ``c - 1`` returned (chunk 0: the
            inputs from ``prepare_batch``) and returns a tensor or a tuple of tensors; the last chunk returns the
            loss function's input.
        loss_fn: ``loss_fn(last_chunk_output, target) -> scalar loss`` (the mean over the micro-batch).
        prepare_batch: ``batch -> (first chunk's positional inputs, loss target)``.
        init_module: initialises one module's own parameters and buffers in place (not its children); used by
            ``materialize`` without a state dict, and for buffers that are not in the state dict. ``None``: call
            ``reset_parameters()`` where a module has it.
        chunk_kwargs: ``batch -> {name: tensor}``, keyword inputs every chunk's ``forward`` takes besides what the
            previous chunk sends (e.g. an attention mask), each with the batch dimension first (split into
            micro-batches like the inputs). ``None``: none.
        token_loss: ``loss_fn`` divides its micro-batch's token sum by ``step_tokens`` (``loss/tokens.py``): its
            losses are shares of the step's per-token mean, back-propagated as they are (every pp rank must know it
            before the step, so it is declared here). False: each is a micro-batch mean, weighted ``1 / M``.
        cp_sharded: at ``cp > 1``, ``prepare_batch`` and ``chunk_kwargs`` return this cp rank's shard of every
            sequence (with the model's ``context_parallel`` handle, set by the strategy after the cut: targets shifted
            on the whole sequence first, the kept tokens' positions where the chunks need them), and ``loss_fn`` is
            the rank's share of the loss. The strategy refuses ``cp > 1`` at ``pp > 1`` for chunks that do not say so
            (rule ``cp-pipeline-chunks``): unsharded sequences would enter the ring as if they were shards.
    """

    modules: Sequence[nn.Module]
    loss_fn: LossFn
    prepare_batch: PrepareBatch
    init_module: InitModule | None = None
    chunk_kwargs: ChunkKwargs | None = None
    token_loss: bool = False
    cp_sharded: bool = False


@runtime_checkable
class PipelineSplittable(Protocol):
    """A model (e.g. a LightningModule) that cuts itself into chunks."""

    def configure_pipeline(self, layout: PipelineLayout) -> PipelineChunks: ...


Splitter = Callable[[nn.Module, PipelineLayout], PipelineChunks]
