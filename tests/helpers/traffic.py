"""A ``CommTraffic`` observer that also keeps the bytes of each collective, in order."""

from __future__ import annotations

from lightning_moe_overlap.overlap.observers import CommTraffic


class Recording(CommTraffic):
    """Every collective's bytes handed to it, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.each: list[int] = []

    def record(self, sent_bytes: int, remote_bytes: int) -> None:
        super().record(sent_bytes, remote_bytes)
        self.each.append(sent_bytes)
