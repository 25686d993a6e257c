"""A Hugging Face transformers v5 MoE causal LM in a LightningModule (built from a config: random init, no download;
or from a saved model's ``config.json``, its weights declared for loading).

The module is plain HF code: the strategy finds the experts of its sparse MoE blocks and makes them
expert-parallel; the model's own routers, shared experts and loss are untouched. Needs ``transformers>=5``
(``pip install -e ".[hf]"`` in a source checkout, ``pip install "lightning-moe-overlap[hf]"`` otherwise).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from lightning_moe_overlap._install import install_hint
from lightning_moe_overlap.demo import log_loss, with_logged_loss
from lightning_moe_overlap.hf.context import check_batch, context_parallel_loss
from lightning_moe_overlap.hf.load import HFWeights
from lightning_moe_overlap.loss.fused import DEFAULT_CHUNK_SIZE
from lightning_moe_overlap.loss.hf import hf_causal_lm_loss, hf_loss
from lightning_moe_overlap.loss.tokens import aux_loss_weight, step_tokens
from lightning_moe_overlap.parallel.context_module import ContextParallel
from lightning_moe_overlap.loss.vocab_parallel import check_loss_parallel, plain_logits
from lightning_moe_overlap.pipeline.batches import lm_batch
from lightning_moe_overlap.config.pipeline_layout import PipelineLayout
from lightning_moe_overlap.pipeline.split import PipelineChunks
from lightning_moe_overlap.pipeline.splitters import split_hf_decoder

ModelType = Literal["qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "deepseek_v3"]

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2, vocab_size=128,
    ),
    "mixtral": dict(
        hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_local_experts=4, num_experts_per_tok=2, vocab_size=128,
    ),
    "qwen2_moe": dict(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
        vocab_size=128,
    ),
    "olmoe": dict(
        hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        num_experts=8, num_experts_per_tok=2, vocab_size=128, pad_token_id=1, bos_token_id=None, eos_token_id=0,
    ),
    "deepseek_v3": dict(  # multi-head latent attention, one shared expert, every layer MoE, the correction bias
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
        n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, vocab_size=128, routed_scaling_factor=1.0,
    ),
}


def build_hf_model(model_type: str, **overrides: Any) -> torch.nn.Module:
    """An HF ``AutoModelForCausalLM`` from a tiny config of ``model_type`` (overrides update the config)."""
    AutoConfig, AutoModelForCausalLM = _transformers("build_hf_model")
    if model_type not in TINY_CONFIGS:
        raise ValueError(f"`build_hf_model`: model_type={model_type!r} is not one of {sorted(TINY_CONFIGS)}.")
    config = AutoConfig.for_model(model_type, **{**TINY_CONFIGS[model_type], **overrides})
    return AutoModelForCausalLM.from_config(config)


def build_hf_model_from(path: str, **overrides: Any) -> torch.nn.Module:
    """An HF ``AutoModelForCausalLM`` from the ``config.json`` of the folder ``path`` (overrides update it), with
    the random init of its config: no weights are read (under the meta device, no memory either).

    Its parameters are float32 (the master weights the Trainer's precision computes from; a published config's
    ``"dtype": "bfloat16"`` says how the files are stored), unless the overrides name a ``dtype``.
    """
    AutoConfig, AutoModelForCausalLM = _transformers("build_hf_model_from")
    check_pretrained_folder(path)
    config = AutoConfig.from_pretrained(path, **overrides)
    dtype = overrides.get("dtype", torch.float32)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def check_pretrained_folder(path: str) -> None:
    """``ValueError`` unless ``path`` is a folder with a ``config.json`` (as ``save_pretrained`` writes it)."""
    where = Path(path)
    problem = "does not exist" if not where.exists() else "has no config.json"
    if not (where / "config.json").is_file():
        raise ValueError(
            f"`HFMoECausalLM`: pretrained={str(path)!r} {problem}. Rule: `pretrained` is a folder as "
            "`save_pretrained` or the Hub writes it (config.json, and the *.safetensors to load). Fix: pass such a "
            "folder (download it first, e.g. `hf download ORG/NAME --local-dir DIR`), or leave `pretrained` out to "
            "build the tiny model of `model_type`."
        )


def _transformers(owner: str) -> tuple[Any, Any]:
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"`{owner}` needs Hugging Face transformers>=5, which is not installed. Install it with "
            f"{install_hint('hf')}."
        ) from err
    return AutoConfig, AutoModelForCausalLM


class HFMoECausalLM(LightningModule):
    """Next-token training of a tiny HF MoE model.

    Args:
        model_type: ``"qwen3_moe"``, ``"mixtral"``, ``"qwen2_moe"``, ``"olmoe"`` or ``"deepseek_v3"``; ignored with
            ``pretrained``.
        lr: Learning rate of the optimizer, torch's ``AdamW`` with its defaults otherwise (betas 0.9 / 0.999, weight
            decay 0.01); override ``configure_optimizers`` for another.
        seed: Seed of the random initialisation (the same model on every rank).
        config_overrides: Updates to the tiny config (e.g. ``{"num_hidden_layers": 4}``), or to the pretrained one.
        pretrained: A folder with ``config.json`` (and the ``*.safetensors`` to load), as ``save_pretrained`` or the
            Hub writes it. The model is then built from that config in ``configure_model`` (on the meta device under
            ``MoEOverlapStrategy``: no rank allocates what it does not hold), and ``hf_weights`` names the folder for
            the loader (the strategy reads each rank's part after sharding; under another strategy the module reads
            the whole checkpoint in ``configure_model``). None: the tiny model of ``model_type``, built in
            ``__init__``.
        fused_cross_entropy: HF's loss without the ``[B, S, V]`` logits: the model's own forward without its head
            (``logits_to_keep`` empty), then ``lm_head`` and the loss in blocks
            (:func:`~lightning_moe_overlap.loss.hf.hf_causal_lm_loss`), at ``pp = 1`` (also at ``tp > 1``) and on the
            last pipeline stage; the router's auxiliary loss is added as HF adds it. ``predict_step`` still computes
            logits.
        cross_entropy_chunk_size: Vocabulary rows (and tokens) per block of the fused loss.

    Attributes:
        context_parallel: ``None``, or at ``cp > 1`` the strategy's handle with which ``_hf_loss`` shards each
            micro-batch's sequences (``hf/context.py``, docs/context_parallel.md).
    """

    context_parallel: ContextParallel | None = None  # set by the strategy at cp > 1

    def __init__(
        self, model_type: ModelType = "qwen3_moe", lr: float = 1e-2, seed: int = 0,
        config_overrides: dict[str, Any] | None = None, pretrained: str | None = None,
        fused_cross_entropy: bool = False, cross_entropy_chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        # the weights the strategy reads into the sharded model after setup (it skips their random init)
        self.hf_weights = None if pretrained is None else HFWeights(pretrained)
        if pretrained is not None:
            check_pretrained_folder(pretrained)  # here, before any process is started
        torch.manual_seed(seed)
        self.model = None if pretrained is not None else build_hf_model(model_type, **(config_overrides or {}))

    def configure_model(self) -> None:
        """With ``pretrained``: build the model from its ``config.json`` (once). Under ``MoEOverlapStrategy`` it is
        built on the meta device and the strategy reads the weights into the sharded model; under any other strategy
        it is built here with values and the weights are read right away, whole, on every rank."""
        if self.model is not None:
            return
        self.model = build_hf_model_from(self.hparams.pretrained, **(self.hparams.config_overrides or {}))
        if self.hf_weights is not None and _other_strategy(self):
            with torch.no_grad():
                self.hf_weights.load_into(self)

    def init_module(self, module: torch.nn.Module) -> None:
        """HF's own initialisation of one module (``_init_weights``): the strategy's hook for a model built on the meta
        device, the one the pipeline split uses too."""
        self.model._init_weights(module)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return log_loss(self, self._hf_loss(batch))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        log_loss(self, self._hf_loss(batch))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        log_loss(self, self._hf_loss(batch))

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        """The most likely next token after each position: ``[B, S]`` token ids."""
        kwargs = lm_batch(batch, type(self.model).__name__).model_kwargs()
        kwargs.pop("labels", None)
        if self.context_parallel is not None:  # whole sequences, no ring, but the model's attention is the ring's
            check_batch(kwargs, self.context_parallel.size)
        return plain_logits(self.model(**kwargs).logits).argmax(dim=-1)

    def _hf_loss(self, batch: Any) -> Tensor:
        """HF's own loss of a batch as the pipeline takes it (docs/pipeline.md, "Batches"): token ids ``[B, S]`` (a
        tensor, or a tuple / list holding one) or a dict with ``input_ids`` and optionally ``labels`` (-100: no
        loss), ``attention_mask``, ``position_ids``; without labels the loss is next-token on ``input_ids``.

        At ``cp > 1`` the labels are shifted on the whole sequence, the batch sharded for this cp rank, and the loss
        is this rank's share of the micro-batch's (``hf/context.py``: the cp ranks' mean is HF's loss)."""
        kwargs = lm_batch(batch, type(self.model).__name__).model_kwargs()
        chunk = self._fused_chunk_size()
        # the sum over the labelled tokens / the step's count (loss/tokens.py): the per-token mean over the step
        tokens = dict(num_items=step_tokens(self, kwargs), aux_weight=aux_loss_weight(self))
        if self.context_parallel is not None:
            return context_parallel_loss(self.model, self.context_parallel, kwargs, chunk_size=chunk, **tokens)
        if chunk is not None:
            return hf_causal_lm_loss(self.model, kwargs, chunk_size=chunk, **tokens)
        check_loss_parallel(self.model.lm_head.weight, "the LM head's weight", type(self).__name__)
        return hf_loss(self.model, kwargs, **tokens)  # at tp > 1 the loss-parallel cross-entropy's, made plain

    def _fused_chunk_size(self) -> int | None:
        """The fused loss's block size, None without it (a subclass that saves other hyperparameters: None)."""
        if not self.hparams.get("fused_cross_entropy", False):
            return None
        return self.hparams.get("cross_entropy_chunk_size", DEFAULT_CHUNK_SIZE)

    def configure_pipeline(self, layout: PipelineLayout) -> PipelineChunks:
        """The pipeline chunks at ``pp > 1``: the built-in split of the HF decoder, its loss logged as the steps
        log it (docs/pipeline.md)."""
        return with_logged_loss(self, split_hf_decoder(self, layout, fused_chunk_size=self._fused_chunk_size()))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def _other_strategy(module: LightningModule) -> bool:
    """Whether ``module`` runs under a Trainer whose strategy is not ``MoEOverlapStrategy`` (which loads the weights
    itself, after sharding)."""
    from lightning_moe_overlap.strategy import MoEOverlapStrategy

    try:
        trainer = module.trainer
    except RuntimeError:  # not attached to a Trainer: whoever calls configure_model loads the weights
        return False
    return not isinstance(trainer.strategy, MoEOverlapStrategy)

