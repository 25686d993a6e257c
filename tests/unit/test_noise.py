"""The third-party noise filters are narrow: the named warning from the named module (or logger) only."""

from __future__ import annotations

import logging
import warnings

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_moe_overlap._noise import ONCE_PER_PROCESS_LOGS, OnceFilter, quiet_third_party_noise
from tests.helpers.records import LogRecords

@pytest.fixture(autouse=True)
def _log_filters_restored():
    """`quiet_third_party_noise` attaches a filter to a process-wide logger: each test starts without it."""
    logger = logging.getLogger(ONCE_PER_PROCESS_LOGS[0][0])
    filters = list(logger.filters)
    logger.filters[:] = [f for f in filters if not isinstance(f, OnceFilter)]
    yield
    logger.filters[:] = filters


LEAFSPEC = "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and treespec.is_leaf()`"


def _warn_from(module: str, message: str, category: type[Warning]) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_third_party_noise()
        warnings.warn_explicit(message, category, filename=f"{module}.py", lineno=1, module=module)
    return caught


def test_lightning_pytree_leafspec_warning_is_filtered():
    assert _warn_from("lightning.pytorch.utilities._pytree", LEAFSPEC, FutureWarning) == []


def test_other_warnings_pass():
    assert len(_warn_from("my_project.model", LEAFSPEC, FutureWarning)) == 1  # same text, someone else's code
    assert len(_warn_from("lightning.pytorch.utilities._pytree", "something else", FutureWarning)) == 1
    assert len(_warn_from("lightning.pytorch.utilities._pytree", LEAFSPEC, UserWarning)) == 1


# torch's own text (torch/distributed/fsdp/_fully_shard/_fsdp_state.py), raised from that module
FSDP_VIEW = (
    "FSDP2-wrapped module (FSDPMoEGPT) returned a view tensor. An in-place op on this view (e.g., `x += y`) will "
    "silently drop the pre-backward hook and skip the all-gather, which can cause backward to fail or produce wrong "
    "gradients. Use out-of-place ops (`out = out + y`, not `out += y`) or `.clone()` the output before any in-place op."
)
FSDP_STATE = "torch.distributed.fsdp._fully_shard._fsdp_state"


def _warn_with(replica_fsdp: bool, module: str, message: str, category: type[Warning]) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_third_party_noise(replica_fsdp=replica_fsdp)
        warnings.warn_explicit(message, category, filename=f"{module}.py", lineno=1, module=module)
    return caught


def test_fsdp_view_warning_is_filtered_only_where_the_strategy_introduced_fsdp():
    assert _warn_with(True, FSDP_STATE, FSDP_VIEW, UserWarning) == []  # shard="none": replicas the user did not ask for
    assert len(_warn_with(False, FSDP_STATE, FSDP_VIEW, UserWarning)) == 1  # shard="optimizer" | "full": kept
    assert len(_warn_with(True, "my_project.model", FSDP_VIEW, UserWarning)) == 1  # same text, someone else's code
    assert len(_warn_with(True, FSDP_STATE, "FSDP2-wrapped module (X) did something else", UserWarning)) == 1


CHECKPOINT_LOGGER, WEIGHTS_ONLY = ONCE_PER_PROCESS_LOGS[0]


@pytest.fixture
def checkpoint_log():
    """The messages Lightning's checkpoint connector lets through."""
    logger = logging.getLogger(CHECKPOINT_LOGGER)
    records, level = LogRecords(), logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    yield records.messages
    logger.removeHandler(records)
    logger.setLevel(level)


def _save_twice(tmp_path) -> None:
    trainer = Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path)
    trainer.fit(BoringModel())
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    trainer.save_checkpoint(tmp_path / "b.ckpt")


def test_lightning_says_weights_only_was_not_set_at_every_save(tmp_path, checkpoint_log):
    """The oracle of the filter below: this Lightning logs the line from that logger once per save."""
    _save_twice(tmp_path)
    assert checkpoint_log.count(WEIGHTS_ONLY) == 2


def test_weights_only_not_set_is_shown_once_per_process_by_global_rank_zero(tmp_path, checkpoint_log):
    quiet_third_party_noise(global_zero=True)
    quiet_third_party_noise(global_zero=True)  # a second Trainer in the same process: still one filter
    assert len([f for f in logging.getLogger(CHECKPOINT_LOGGER).filters if isinstance(f, OnceFilter)]) == 1
    _save_twice(tmp_path)
    assert checkpoint_log.count(WEIGHTS_ONLY) == 1
    logging.getLogger(CHECKPOINT_LOGGER).info("something else")
    assert checkpoint_log[-1] == "something else"  # other records pass


def test_weights_only_not_set_is_not_shown_by_other_ranks(tmp_path, checkpoint_log):
    quiet_third_party_noise(global_zero=False)
    _save_twice(tmp_path)
    assert WEIGHTS_ONLY not in checkpoint_log


def test_torch_s_sequential_all_gather_to_replicate_log_is_dropped_and_nothing_else():
    """torch's redistribute warns (with these format arguments) when it gathers a 2-D sharded DTensor in several
    all-gathers; gathered whole (``Replicate``) nothing is reduced, so the package's own consolidation drops it. A
    reduce-scatter, or a gather to another placement, still shows."""
    import importlib

    from lightning_moe_overlap._noise import DROPPED_LOGS, DropFilter

    name = DROPPED_LOGS[0][0]
    assert importlib.import_module(name).logger.name == name  # the logger torch warns through
    logger = logging.getLogger(name)
    filters = list(logger.filters)
    try:
        quiet_third_party_noise()
        quiet_third_party_noise()  # idempotent: one filter
        assert sum(isinstance(f, DropFilter) for f in logger.filters) == 1
        text = (
            "While redistributing from %s to %s, %d sequential %s operations will be performed. This is suboptimal: "
            "multiple collective operations have higher latency (separate kernel launches and synchronization "
            "points) and may give inconsistent results between ranks due to different reduction orders. %s"
        )
        seen: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
        logger.addHandler(handler)
        try:
            strided = "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
            logger.warning(text, strided, "(Replicate(), Replicate())", 2, "all_gather", "not ascending.")
            partial, shards = "(Partial(sum), Partial(sum))", "(Shard(dim=0), Shard(dim=0))"
            logger.warning(text, partial, shards, 2, "reduce_scatter", "")
            logger.warning(text, strided, "(Replicate(), Shard(dim=0))", 2, "all_gather", "not ascending.")
        finally:
            logger.removeHandler(handler)
        assert len(seen) == 2 and "reduce_scatter" in seen[0] and "(Replicate(), Shard(dim=0))" in seen[1], seen
    finally:
        logger.filters[:] = filters
