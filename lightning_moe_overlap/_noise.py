"""Third-party warnings that are not ours to fix and would otherwise land inside the progress bar.

Each filter is narrow: one message, one category, raised from one module (or one logger). Installed by the strategy
in every rank.
"""

from __future__ import annotations

import logging
import re
import warnings

# (message regex, category, module regex of the code that triggers it)
Filter = tuple[str, type[Warning], str]

THIRD_PARTY_NOISE: tuple[Filter, ...] = (
    # torch >= 2.10 deprecates `LeafSpec`; Lightning's own pytree code still uses it on every batch.
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning, r"lightning\.pytorch\.utilities\._pytree"),
    # torch announces that slicing a flattened dimension together with a root one (`mesh[("dp_cp", "unit")]`) will
    # be deprecated, yet offers no other way to a 2-D mesh whose first dimension is a flattened one: the replicated
    # parameters' `(dp_cp, unit)` mesh (`ParallelMesh.replicate_mesh`) must be sliced from the root so that it holds
    # tp `DTensor`s too. Raised once per rank at setup; the slice is torch 2.13's supported path.
    (r"Slicing a flattened dim from root mesh will be deprecated", UserWarning, r"torch\.distributed\.device_mesh"),
)

# FSDP2 the strategy applies on its own at `shard="none"`, only to make the dense parameters DTensor replicas
# (parallelize/sharding.py): torch warns on every rank, for any model whose output is a view (a biased Linear on 3-D
# input), that an in-place op on it would skip the pre-backward all-gather. There the parameters are gathered once
# per step before the first forward and stay gathered until the strategy reduces the gradients after the last
# backward, so that all-gather is never the one the step relies on, and the user did not ask for FSDP. With
# `shard="optimizer" | "full"` the user did, and the warning stays.
REPLICA_FSDP_NOISE: tuple[Filter, ...] = (
    (
        r"FSDP2-wrapped module \(.*\) returned a view tensor",
        UserWarning,
        r"torch\.distributed\.fsdp\._fully_shard\._fsdp_state",
    ),
)


# Lightning logs this (INFO, to the console) from `dump_checkpoint` at every `trainer.save_checkpoint(path)` that
# leaves `weights_only` unset, on every rank: the same line once per rank and again at every save. It is true (the
# optimizer and callback states are saved too), so it is shown, once per process, by global rank 0.
ONCE_PER_PROCESS_LOGS: tuple[tuple[str, str], ...] = (
    ("lightning.pytorch.trainer.connectors.checkpoint_connector", "`weights_only` was not set, defaulting to `False`."),
)


# torch logs this (WARNING) each time a DTensor sharded over two mesh dimensions in non-ascending order (the experts
# of `shard="optimizer" | "full"`: `_StridedShard` over edp, then `Shard` over ep) is gathered whole in more than one
# all-gather: on every rank, for every expert tensor of every `full_state_dict()` and consolidated checkpoint. It
# speaks of "different reduction orders", but an all-gather to `Replicate` reduces nothing, and this gather is the
# package's own (off the training step). Dropped for that case only: another comm type or placement still shows.
DROPPED_LOGS: tuple[tuple[str, str], ...] = (
    (
        "torch.distributed.tensor._redistribute",
        r"While redistributing from .* to \(Replicate\(\)(, Replicate\(\))*\), \d+ sequential all_gather operations",
    ),
)


class DropFilter(logging.Filter):
    """Drops the records whose message matches ``pattern`` (from its start); other records pass."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return self.pattern.match(record.getMessage()) is None


class OnceFilter(logging.Filter):
    """Lets the first record of ``message`` through where ``show``, and none of it after; other records pass.

    Attached to the logger that emits the message, so its state lives as long as the process (as a warnings
    registry does)."""

    def __init__(self, message: str, show: bool) -> None:
        super().__init__()
        self.message = message
        self.show = show
        self.shown = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() != self.message:
            return True
        first, self.shown = not self.shown, True
        return first and self.show


def once_filter(logger_name: str, message: str) -> OnceFilter | None:
    """The :class:`OnceFilter` of ``message`` installed on ``logger_name``, or None."""
    found = [f for f in logging.getLogger(logger_name).filters if isinstance(f, OnceFilter) and f.message == message]
    return found[0] if found else None


def quiet_third_party_noise(*, replica_fsdp: bool = False, global_zero: bool = True) -> None:
    """Install the filters (idempotent: ``warnings`` drops an identical filter before adding it again, and a log
    message keeps its one :class:`OnceFilter`).

    Args:
        replica_fsdp: also the warnings of the FSDP2 the strategy introduced itself (``shard="none"``).
        global_zero: whether this process is global rank 0, the one that shows the once-per-process log lines.
    """
    for message, category, module in THIRD_PARTY_NOISE + (REPLICA_FSDP_NOISE if replica_fsdp else ()):
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for logger_name, pattern in DROPPED_LOGS:
        logger = logging.getLogger(logger_name)
        if not any(isinstance(f, DropFilter) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(DropFilter(pattern))
    for logger_name, message in ONCE_PER_PROCESS_LOGS:
        installed = once_filter(logger_name, message)
        if installed is None:
            logging.getLogger(logger_name).addFilter(OnceFilter(message, show=global_zero))
        else:
            installed.show = global_zero
