"""Published Hugging Face checkpoints in and out: key adapters (:mod:`.families`), loading into a sharded model
(:mod:`.load`, each rank reading only what it holds; :mod:`.pretrained`, ``from_pretrained`` in ``configure_model``
built on meta and declared for that load) and export to the Hub layout (:mod:`.export`).
docs/hf_checkpoints.md describes them."""

from lightning_moe_overlap.hf.key_match import HFKeysError
from lightning_moe_overlap.hf.export import export_hf
from lightning_moe_overlap.hf.families import HF_FAMILIES, register_hf_family, unregister_hf_family
from lightning_moe_overlap.hf.keys import HFFamily, Piece, Split, hub_experts
from lightning_moe_overlap.hf.load import HFLoadReport, HFWeights, load_hf_weights, module_tensors

__all__ = [
    "HF_FAMILIES", "HFFamily", "HFKeysError", "HFLoadReport", "HFWeights", "Piece", "Split", "export_hf", "hub_experts",
    "load_hf_weights", "module_tensors", "register_hf_family", "unregister_hf_family",
]
