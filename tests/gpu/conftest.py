"""The GPU suite's process-wide settings, made before any test runs.

cuBLAS reads ``CUBLAS_WORKSPACE_CONFIG`` once, when a process creates its first cuBLAS handle (its first GEMM).
The bitwise comparisons under ``torch.use_deterministic_algorithms(True)`` need a fixed workspace, so the variable
is set here, when pytest imports this file while collecting, before the first test of any directory runs a GEMM.
A value the user exported is kept.
"""

from __future__ import annotations

import os

CUBLAS_WORKSPACE = ":4096:8"

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
