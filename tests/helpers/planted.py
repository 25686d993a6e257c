"""A pickle planted in a checkpoint: unpickling it runs :func:`_plant`, which creates a marker file, so a test can
tell from the file system whether a load ran code from the checkpoint."""

from __future__ import annotations

from pathlib import Path


def _plant(marker: str) -> str:
    """What the planted pickle runs when it is unpickled: creates ``marker``."""
    Path(marker).touch()
    return "planted"


class Planted:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):  # noqa: ANN204
        return (_plant, (self.marker,))
