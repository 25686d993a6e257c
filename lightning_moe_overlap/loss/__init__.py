"""Losses computed without their largest intermediate: the fused linear cross-entropy (``fused.py``, the block math
in ``blocks.py``) and its use by Hugging Face causal LMs (``hf.py``)."""

from lightning_moe_overlap.loss.fused import DEFAULT_CHUNK_SIZE, fused_linear_cross_entropy

__all__ = ["DEFAULT_CHUNK_SIZE", "fused_linear_cross_entropy"]
