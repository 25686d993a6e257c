"""The multiprocessing launcher for ``start_method="spawn"|"fork"|"forkserver"``.

Lightning's launcher sends rank 0's ``state_dict()`` back to the main process, whose model was never made
expert-parallel: rank 0 holds only its own experts, so the shapes would not match and the other ranks' experts
would be lost. This launcher sends the unsharded state (every expert, gathered over the ep group) instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_moe_overlap import _compat

if TYPE_CHECKING:
    from lightning.pytorch import Trainer


class ExpertParallelSpawnLauncher(_compat._MultiProcessingLauncher):
    def _collect_rank_zero_results(self, trainer: Trainer, results: Any) -> Any:
        module = trainer.lightning_module
        full = self._strategy.full_state_dict()  # collective: every rank takes part, rank 0 receives
        module.state_dict = lambda *args, **kwargs: full if full is not None else {}  # read by the parent method
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            del module.state_dict
