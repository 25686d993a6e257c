"""Published Hugging Face checkpoints in and out: key adapters (:mod:`.families`), loading into a sharded model
(:mod:`.load`, each rank reading only what it holds; :mod:`.pretrained`, ``from_pretrained`` in ``configure_model``
built on meta and declared for that load) and export to the Hub layout (:mod:`.export` of whole tensors,
:mod:`.sharded_export` from every rank's share).
docs/hf_checkpoints.md describes them."""

from lightning_moe_overlap.hf.key_match import HFKeysError
from lightning_moe_overlap.hf.export import export_hf
from lightning_moe_overlap.hf.families import HF_FAMILIES, register_hf_family, unregister_hf_family
from lightning_moe_overlap.hf.keys import HFFamily, Piece, Split, hub_experts
from lightning_moe_overlap.hf.load import HFLoadReport, HFWeights, load_hf_weights, module_tensors
from lightning_moe_overlap.hf.sharded_export import ExportReport, export_checkpoint_hf, export_hf_sharded

__all__ = [
    "HF_FAMILIES", "ExportReport", "HFFamily", "HFKeysError", "HFLoadReport", "HFWeights", "Piece", "Split",
    "export_checkpoint_hf", "export_hf", "export_hf_sharded", "hub_experts", "load_hf_weights", "module_tensors",
    "register_hf_family", "unregister_hf_family",
]
