"""Memory callbacks: selective / full activation recompute and fine-grained activation offload.

``MoEMonitor`` (routing balance and hidden communication in the logger) and ``OverlapTimeline`` (one step as a
trace and a picture) observe a run; see docs/monitoring.md. The memory callbacks act on the model's own decoder layers through a name map (:func:`register_layer_names`), compose with the
overlap schedule, and can be listed in ``trainer.callbacks`` or in a LightningCLI config by class path
(``lightning_moe_overlap.callbacks.SelectiveRecompute``). See docs/memory.md.
"""

from lightning_moe_overlap.callbacks.activation_offload import ActivationOffload
from lightning_moe_overlap.callbacks.expert_balance import ExpertBalance
from lightning_moe_overlap.callbacks.layer_specs import (
    OFFLOAD_MODULE_NAMES,
    OFFLOAD_TENSOR_NAMES,
    RECOMPUTE_NAMES,
    ExpertStage,
    Output,
    SDPACall,
    find_layers,
    register_layer_names,
    unregister_layer_names,
)
from lightning_moe_overlap.callbacks.meter import SavedActivationMeter
from lightning_moe_overlap.callbacks.monitor import MoEMonitor
from lightning_moe_overlap.callbacks.offload_engine import OffloadEngine, OffloadStats
from lightning_moe_overlap.callbacks.recompute import SelectiveRecompute
from lightning_moe_overlap.callbacks.timeline_callback import OverlapTimeline

__all__ = [
    "OFFLOAD_MODULE_NAMES",
    "OFFLOAD_TENSOR_NAMES",
    "RECOMPUTE_NAMES",
    "ActivationOffload",
    "ExpertBalance",
    "ExpertStage",
    "MoEMonitor",
    "OffloadEngine",
    "OffloadStats",
    "OverlapTimeline",
    "Output",
    "SDPACall",
    "SavedActivationMeter",
    "SelectiveRecompute",
    "find_layers",
    "register_layer_names",
    "unregister_layer_names",
]
