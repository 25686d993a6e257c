"""Every test runs in its own temporary directory, so nothing (``lightning_logs/``, ``config.yaml``, checkpoints)
lands in the repository; tests that need the repository name it by absolute path."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _run_in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _restore_rank_zero(monkeypatch):
    """Lightning sets the process-wide ``rank_zero_only.rank`` when a Trainer reads a cluster environment (a test
    emulating SLURM rank 11 does); put it back so later tests' rank-zero warnings are not swallowed."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    monkeypatch.setattr(rank_zero_only, "rank", getattr(rank_zero_only, "rank", 0))


@pytest.fixture(autouse=True)
def _scoped_registries():
    """Adapters and layer names are process-wide registries: undo whatever a test registers."""
    from lightning_moe_overlap.callbacks.layer_specs import LAYER_SPECS
    from lightning_moe_overlap.moe.adapters import ADAPTERS

    with ADAPTERS.scoped(), LAYER_SPECS.scoped():
        yield


@pytest.fixture
def world_of_one(tmp_path):
    """A default process group of one gloo rank (file store), for single-process tests of mesh and FSDP code."""
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    if owned:
        dist.destroy_process_group()
