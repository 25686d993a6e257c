"""Each rank's random generators, saved with the checkpoint so a resumed run draws the same numbers (dropout).

The state is per rank (ranks draw different streams), so it is restored only when the world size is the same;
at another layout the generators keep their fresh state (the loss curve then continues only statistically).
"""

from __future__ import annotations

import io
import random
from typing import Any

import torch


def capture_rng() -> bytes:
    """Python, NumPy (if installed), torch CPU and, when CUDA is initialised, every CUDA device's generator."""
    states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        states["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy is optional
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    buffer = io.BytesIO()
    torch.save(states, buffer)
    return buffer.getvalue()


def restore_rng(blob: bytes) -> None:
    """Set the generators captured by :func:`capture_rng`."""
    states = torch.load(io.BytesIO(blob), weights_only=False)
    random.setstate(states["python"])
    torch.set_rng_state(states["torch"])
    if "numpy" in states:
        import numpy as np

        np.random.set_state(states["numpy"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
