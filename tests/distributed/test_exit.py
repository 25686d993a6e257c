"""A rank that exits right after its last collective exits cleanly.

Without the strategy's exit handler, a gloo worker thread that still holds the collective's tensors when the
interpreter finalizes aborts the rank (SIGABRT). The race depends on timing (without the handler, a trial here
aborts about every second time), so the test runs several trials, each in fresh processes set up by the strategy.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch import Trainer

from lightning_moe_overlap import MoEOverlapStrategy
from tests.helpers.distributed import free_port

TRIALS = 4


def _rank(rank: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
        NODE_RANK="0",
    )
    torch.set_num_threads(1)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=MoEOverlapStrategy(ep=2), logger=False)
    trainer.strategy.setup_environment()  # initialises the process group, as `fit` does
    sys.setswitchinterval(60)  # the main thread keeps the GIL until it blocks: the exit race at its widest
    pieces = [torch.empty(64, 1024) for _ in range(2)] if rank == 0 else None
    dist.gather(torch.randn(64, 1024) * 2, pieces, dst=0, group=trainer.strategy.parallel_groups.ep)
    # returns at once: the sent tensor was a temporary, and the process exits


@pytest.mark.long  # several trials of a timing race, fresh processes each
def test_ranks_exit_cleanly_right_after_their_last_collective():
    for _ in range(TRIALS):  # raises ProcessExitedException naming the signal if a rank aborts
        mp.start_processes(_rank, args=(free_port(),), nprocs=2, start_method="spawn")
