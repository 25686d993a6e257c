"""The strategy's settings as one frozen value, so validation and the ``check`` command read the same thing.

The option sets are spelled once, here, as ``Literal`` types (the strategy's signature uses them, so LightningCLI
offers exactly these) and as tuples derived from them (what validation and the factories check against).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

Dispatcher = Literal["alltoall", "allgather", "flex"]
FlexBackend = Literal["deepep"]
DropPolicy = Literal["probs", "position"]
StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
ExpertBackend = Literal["torch", "te"]
CheckpointFormat = Literal["sharded", "consolidated"]

DISPATCHERS: tuple[str, ...] = get_args(Dispatcher)
FLEX_BACKENDS: tuple[str, ...] = get_args(FlexBackend)
DROP_POLICIES: tuple[str, ...] = get_args(DropPolicy)
START_METHODS: tuple[str, ...] = get_args(StartMethod)
EXPERT_BACKENDS: tuple[str, ...] = get_args(ExpertBackend)
CHECKPOINT_FORMATS: tuple[str, ...] = get_args(CheckpointFormat)


def resolve_overlap(overlap: bool | None, num_microbatches: object) -> bool:
    """``overlap=None`` (the strategy's default) means on whenever there is a second micro-batch to overlap with."""
    if overlap is not None:
        return overlap
    return isinstance(num_microbatches, int) and not isinstance(num_microbatches, bool) and num_microbatches > 1


@dataclass(frozen=True)
class OverlapConfig:
    """Everything :class:`MoEOverlapStrategy` was asked for; see the strategy's docstring for each field."""

    ep: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    dispatcher: str = "alltoall"
    flex_backend: str | None = None
    overlap: bool = True
    delay_wgrad: bool = False
    num_microbatches: int = 1
    capacity_factor: float | None = None
    token_drop_policy: str = "probs"
    shared_expert_overlap: bool = False
    deepep_num_sms: int = 20
    alltoall_dedup: bool = False
    process_group_backend: str | None = None
    start_method: str = "popen"
    expert_backend: str = "torch"

    @property
    def resolved_flex_backend(self) -> str | None:
        """The flex backend in effect: ``deepep`` by default once ``dispatcher="flex"``."""
        if self.dispatcher != "flex":
            return None
        return self.flex_backend or "deepep"
