"""lightning-moe-overlap: expert-parallel all-to-all overlap for Mixture-of-Experts training in Lightning.

Importing the package registers the strategy under the names ``moe_overlap`` and ``moe_overlap_spawn``, so
``Trainer(strategy="moe_overlap")`` and ``--trainer.strategy=moe_overlap`` work.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_moe_overlap.callbacks import (
    ActivationOffload,
    ExpertBalance,
    MoEMonitor,
    OverlapTimeline,
    SelectiveRecompute,
)
from lightning_moe_overlap.config import OverlapConfig
from lightning_moe_overlap.loss.tokens import step_tokens
from lightning_moe_overlap.parallel import ParallelDims, ParallelGroups
from lightning_moe_overlap.resumable_loader import ResumableDataLoader
from lightning_moe_overlap.strategy import MoEOverlapStrategy

__version__ = "0.1.0"

MoEOverlapStrategy.register_strategies(StrategyRegistry)  # idempotent: skips names already registered

__all__ = [
    "ActivationOffload",
    "ExpertBalance",
    "MoEMonitor",
    "MoEOverlapStrategy",
    "OverlapConfig",
    "OverlapTimeline",
    "ParallelDims",
    "ParallelGroups",
    "ResumableDataLoader",
    "SelectiveRecompute",
    "__version__",
    "step_tokens",
]
