"""Checkpoints through torch's state-dict API and DCP: exact resume, any ep / dp / pp layout, atomic
(docs/checkpoints.md).

- :mod:`.state`: model and optimizer state keyed by the unsplit model's names (``get_model_state_dict``,
  ``get_optimizer_state_dict``, ``set_*``), the tensors this rank holds only.
- :mod:`.sharded`: every rank writes its part into one DCP directory; DCP reshards on load.
- :mod:`.consolidated`: one file with every tensor unsharded, as an unsharded run would write it.
- :mod:`.fit_checks`: does a checkpoint fit the model, decided before any tensor is read.
- :mod:`.optimizer`: optimizer state between torch's index-keyed and the name-keyed forms.
- :mod:`.legacy`: reading and converting directories of format version 1 (per-expert keys).
- :mod:`.atomic`: staging names, the commit marker, the rename.
- :mod:`.rng_state`: each rank's random generators.
- :mod:`.safe_load`: every file read without running code from it (``weights_only``, the default).
- :mod:`.checkpointer`: what the strategy's checkpoint hooks do.
"""

from lightning_moe_overlap.checkpoint.checkpointer import FORMATS, CheckpointFormat
from lightning_moe_overlap.checkpoint.consolidated import consolidate_checkpoint, load_consolidated_state_dict
from lightning_moe_overlap.checkpoint.legacy import convert_legacy_checkpoint

__all__ = [
    "FORMATS", "CheckpointFormat", "consolidate_checkpoint", "convert_legacy_checkpoint",
    "load_consolidated_state_dict",
]
