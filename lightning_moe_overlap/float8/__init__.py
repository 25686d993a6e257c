"""FP8 numerics: the scaling recipes, quantisation, FP8 rows that travel through the dispatchers, and the scaled
GEMM. What the MoE layers and dispatchers need from FP8 lives here, below them; converting a model's linears and
experts to FP8 is the ``fp8`` package, above them (docs/fp8.md)."""
