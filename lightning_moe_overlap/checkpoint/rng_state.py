"""Each rank's random generators, saved with the checkpoint so a resumed run draws the same numbers (dropout).

The state is per rank (ranks draw different streams), so it is restored only when the world size is the same;
at another layout the generators keep their fresh state (the loss curve then continues only statistically).

The saved state is plain data (a weights-only load reads it): NumPy's key array is kept as a list of ints. States
written before held the NumPy array itself; :func:`~.safe_load.load_rng` allows exactly its reconstruction.
"""

from __future__ import annotations

import io
import random
from typing import Any

import torch

from lightning_moe_overlap.checkpoint.safe_load import load_rng


def capture_rng() -> bytes:
    """Python, NumPy (if installed), torch CPU and, when CUDA is initialised, every CUDA device's generator."""
    states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        states["numpy"] = (name, keys.tolist(), int(pos), int(has_gauss), float(cached))
    except ImportError:  # pragma: no cover - numpy is optional
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    buffer = io.BytesIO()
    torch.save(states, buffer)
    return buffer.getvalue()


def read_rng(blob: bytes, where: str, *, weights_only: bool = True) -> dict[str, Any]:
    """The generator states in ``blob`` (from :func:`capture_rng`); ``where`` names it in a refusal.

    Raises:
        ValueError: ``weights_only`` and the state needs more than plain data (:mod:`.safe_load`).
    """
    return load_rng(blob, where, weights_only=weights_only)


def restore_rng(states: dict[str, Any]) -> None:
    """Set the generators to ``states`` (from :func:`read_rng`)."""
    random.setstate(states["python"])
    torch.set_rng_state(states["torch"])
    if "numpy" in states:
        import numpy as np

        name, keys, *rest = states["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
