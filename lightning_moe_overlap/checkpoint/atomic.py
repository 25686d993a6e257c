"""Checkpoints appear complete or not at all: write under a staging name, mark the write done, then rename.

A save writes into ``<path>.partial-<token>`` (a directory for sharded checkpoints, a file for consolidated ones).
Only when every rank has finished does the coordinator write the commit marker ``COMMIT`` into a staging
directory and rename the staging name to ``<path>``. A run killed while writing leaves at most a ``.partial-``
staging entry, which no loader accepts: a sharded directory without ``COMMIT`` is refused with a message that
says so, even when it was copied or renamed by hand, and Lightning's ``ckpt_path="last"`` never names one (its
suffix is not ``.ckpt``). The next save of the same checkpoint removes those of its name (:func:`leftovers`), and a
resume logs the others of its directory as ignored. Replacing an existing checkpoint (``last.ckpt``) moves the
old one aside first and deletes it after the rename, so a complete checkpoint exists at every moment.

Local or mounted shared filesystems only (``os.rename`` semantics); every rank must see the same directory.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

COMMIT_MARKER = "COMMIT"
PARTIAL = ".partial-"


def local_path(path: str | os.PathLike, owner: str) -> Path:
    """``path`` as a local ``Path``; remote URLs are refused."""
    text = os.fspath(path)
    if "://" in text:
        raise NotImplementedError(
            f"{owner}: checkpoint path {text!r} is a URL; expert-parallel checkpoints are written with "
            "`os.rename` for atomicity, which needs a local or mounted shared filesystem. Mount the storage and "
            "pass a filesystem path."
        )
    return Path(text)


def staging_path(path: Path, token: str) -> Path:
    """Where a save of ``path`` writes before it is committed."""
    return path.with_name(f"{path.name}{PARTIAL}{token}")


def write_marker(staging_dir: Path, info: dict[str, Any]) -> None:
    """Write the commit marker into a finished staging directory (the coordinator, after every rank wrote)."""
    marker = staging_dir / COMMIT_MARKER
    with open(marker, "w") as f:
        json.dump(info, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(staging_dir)


def publish(staging: Path, path: Path, token: str) -> None:
    """Rename the finished ``staging`` file or directory to ``path``, replacing what is there."""
    if staging.is_file():
        with open(staging, "rb") as f:
            os.fsync(f.fileno())
    old = None
    if path.exists() or path.is_symlink():
        old = path.with_name(f"{path.name}.old-{token}")
        os.replace(path, old)
    os.replace(staging, path)
    _fsync_dir(path.parent)
    if old is not None:
        remove(old)


def leftovers(folder: Path, name: str = "", keep: str = "") -> list[Path]:
    """The staging entries in ``folder`` that interrupted saves left (``<name>.partial-<token>``): of checkpoint
    ``name`` only, or of every checkpoint without one; the one of token ``keep`` excepted."""
    if not folder.is_dir():
        return []
    return sorted(
        p for p in folder.glob(f"{name or '*'}{PARTIAL}*") if not (keep and p.name.endswith(f"{PARTIAL}{keep}"))
    )


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def read_marker(path: Path) -> dict[str, Any]:
    """The commit marker of a sharded checkpoint directory.

    Raises:
        FileNotFoundError: nothing at ``path``.
        RuntimeError: the directory has no marker: its save did not finish.
    """
    if not path.exists():
        raise FileNotFoundError(f"`MoEOverlapStrategy`: no checkpoint at {path}. Check the path.")
    marker = path / COMMIT_MARKER
    if not marker.is_file():
        hint = " Its name marks it as a staging directory of an interrupted save." if PARTIAL in path.name else ""
        raise RuntimeError(
            f"`MoEOverlapStrategy`: the checkpoint directory {path} is incomplete: it has no `{COMMIT_MARKER}` "
            f"marker, so the save that wrote it did not finish (the run stopped while writing).{hint} Only "
            "checkpoints whose save completed are loaded. Resume from an earlier checkpoint, and delete this one."
        )
    with open(marker) as f:
        return json.load(f)


def check_not_staging(path: Path) -> None:
    """Refuse a consolidated file still under its staging name (its write may not have finished)."""
    if PARTIAL in path.name:
        raise RuntimeError(
            f"`MoEOverlapStrategy`: {path} is the staging file of a save that was not committed (its name has "
            f"`{PARTIAL}`), so it may be incomplete. Only committed checkpoints are loaded. Resume from the "
            "checkpoint without the suffix, or an earlier one, and delete this file."
        )


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)
