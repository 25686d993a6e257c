"""`srun ... lightning-moe-overlap fit ...` (docs/launch.md): under SLURM every task is a rank that Lightning's
`SLURMEnvironment` describes; the strategy takes its ranks from it and starts no process of its own."""

from __future__ import annotations

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.environments import SLURMEnvironment

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.processes.launcher import ExpertParallelScriptLauncher

# task 11 of `srun --nodes=2 --ntasks-per-node=8`: node 1, local rank 3
SLURM_TASK_11 = {
    "SLURM_NTASKS": "16", "SLURM_NTASKS_PER_NODE": "8", "SLURM_NNODES": "2", "SLURM_JOB_NAME": "moe",
    "SLURM_JOB_ID": "123456", "SLURM_PROCID": "11", "SLURM_LOCALID": "3", "SLURM_NODEID": "1",
    "SLURM_NODELIST": "node[001-002]",
}


@pytest.fixture
def slurm_task(monkeypatch):
    for key in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in SLURM_TASK_11.items():
        monkeypatch.setenv(key, value)


def test_slurm_task_becomes_its_rank_without_spawning(slurm_task):
    trainer = Trainer(
        accelerator="cpu", devices=8, num_nodes=2, logger=False,
        strategy=MoEOverlapStrategy(ep=8, num_microbatches=4),
    )
    strategy = trainer.strategy
    assert isinstance(strategy.cluster_environment, SLURMEnvironment)
    assert isinstance(strategy.launcher, ExpertParallelScriptLauncher)
    strategy.set_world_ranks()
    assert (strategy.global_rank, strategy.local_rank, strategy.node_rank, strategy.world_size) == (11, 3, 1, 16)
    coords = strategy.dims.coords(11)
    assert (strategy.dims.dp, strategy.dims.ep, coords.dp) == (16, 8, 11)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 16, "rank": 11}
    env = strategy.cluster_environment
    assert env.main_address == "node001" and env.main_port == 15000 + 3456
    assert strategy.launcher.launch(lambda: "ran") == "ran"  # the task runs itself; srun started the others
    assert strategy.launcher.procs == []


def test_slurm_tasks_per_node_must_match_devices(slurm_task):
    trainer = Trainer(accelerator="cpu", devices=4, num_nodes=2, logger=False, strategy=MoEOverlapStrategy(ep=4))
    with pytest.raises(ValueError, match=r"`--ntasks-per-node=8` does not match"):
        trainer.strategy.launcher.launch(lambda: None)
