"""Expert-parallel checkpoints: nothing lost, exact resume, any ep / pp layout, atomic (docs/checkpoints.md).

- :mod:`.keys`: layout-free names for expert tensors (``name[e]``) and the model state in that form.
- :mod:`.held`: what a rank holds at pp > 1 (tensors not on meta); the other pp ranks' keys are absent here.
- :mod:`.optimizer`: optimizer state keyed by parameter name, split per expert the same way.
- :mod:`.sharded`: every rank writes its part into one ``torch.distributed.checkpoint`` directory.
- :mod:`.consolidated`: one file with the full experts, as an unsharded run would write it.
- :mod:`.atomic`: staging names, the commit marker, the rename.
- :mod:`.rng`: each rank's random generators.
- :mod:`.checkpointer`: what the strategy's checkpoint hooks do.
"""

from lightning_moe_overlap.checkpoint.checkpointer import FORMATS, CheckpointFormat
from lightning_moe_overlap.checkpoint.consolidated import consolidate_checkpoint, load_consolidated_state_dict

__all__ = ["FORMATS", "CheckpointFormat", "consolidate_checkpoint", "load_consolidated_state_dict"]
