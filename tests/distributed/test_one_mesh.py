"""One mesh per run, handed to the LightningModule before ``configure_model`` (2 gloo ranks, ep=2).

Oracles, per rank: inside ``configure_model`` the module already has ``device_mesh`` (the strategy's root mesh,
every dimension named) and ``parallel_groups``; every group the layers and the sharding use is a group of that
mesh (the same communicator object as the mesh's view of that kind); no process group spanning several ranks
is created after ``setup_environment`` (``new_group`` counted through ``setup``).
"""

from __future__ import annotations

import torch.distributed as dist
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo import MoEGPT, _PatternTokens
from lightning_moe_overlap.parallel.dims import GROUP_KINDS
from tests.helpers.distributed import run_distributed


class _Probe(MoEGPT):
    def __init__(self) -> None:
        super().__init__(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, num_experts=4, top_k=2,
                         ffn_hidden_size=8, lr=1e-2)
        self.seen_in_configure: dict | None = None

    def configure_model(self) -> None:
        mesh = self.device_mesh
        self.seen_in_configure = {
            "names": None if mesh is None else tuple(mesh.mesh_dim_names),
            "groups": getattr(self, "parallel_groups", None) is not None,
        }
        super().configure_model()

    def train_dataloader(self):
        return DataLoader(_PatternTokens(8, 8, 32, seed=0), batch_size=2, drop_last=True)


def _worker(rank: int, world: int) -> dict:
    created: list[list[int]] = []
    new_group = dist.new_group

    def counting(ranks=None, **kwargs):
        created.append(list(ranks) if ranks is not None else [])
        return new_group(ranks, **kwargs)

    model = _Probe()
    strategy = MoEOverlapStrategy(ep=2, num_microbatches=2)
    trainer = Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    original_setup = strategy.setup

    def setup(trainer):  # count the groups made between configure_model and the first step
        dist.new_group = counting
        try:
            original_setup(trainer)
        finally:
            dist.new_group = new_group

    strategy.setup = setup
    trainer.fit(model)
    mesh = strategy.parallel_mesh
    same = {kind: getattr(strategy.parallel_groups, kind) is mesh.group(kind) for kind in GROUP_KINDS}
    return {
        "configure": model.seen_in_configure,
        "same": same,
        "module_mesh": model.device_mesh is mesh.device_mesh,
        "module_groups": model.parallel_groups is strategy.parallel_groups,
        "spanning_groups_in_setup": [r for r in created if len(r) != 1],
    }


def test_the_module_gets_the_one_mesh_before_configure_model_and_every_group_is_its() -> None:
    for rank, r in enumerate(run_distributed(_worker, 2, timeout_s=120)):
        assert r["configure"] == {"names": ("pp", "edp", "dp", "cp", "tp", "unit"), "groups": True}, (rank, r)
        assert all(r["same"].values()), (rank, r["same"])
        assert r["module_mesh"] and r["module_groups"], rank
        assert r["spanning_groups_in_setup"] == [], (rank, r["spanning_groups_in_setup"])
