"""The strategy's settings as one frozen value, so validation and the ``check`` command read the same thing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Dispatcher = Literal["alltoall", "allgather", "flex"]
FlexBackend = Literal["deepep"]
DropPolicy = Literal["probs", "position"]
StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
ExpertBackend = Literal["torch", "te"]

DISPATCHERS: tuple[str, ...] = ("alltoall", "allgather", "flex")
FLEX_BACKENDS: tuple[str, ...] = ("deepep",)
DROP_POLICIES: tuple[str, ...] = ("probs", "position")
START_METHODS: tuple[str, ...] = ("popen", "spawn", "fork", "forkserver")
EXPERT_BACKENDS: tuple[str, ...] = ("torch", "te")


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
    process_group_backend: str | None = None
    start_method: str = "popen"
    expert_backend: str = "torch"

    @property
    def resolved_flex_backend(self) -> str | None:
        """The flex backend in effect: ``deepep`` by default once ``dispatcher="flex"``."""
        if self.dispatcher != "flex":
            return None
        return self.flex_backend or "deepep"
