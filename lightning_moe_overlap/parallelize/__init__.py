"""Parallelising a LightningModule: the steps in their order (``steps.py``: pipeline split, meta build, tensor and
context parallelism, expert parallelism, FP8, FSDP2, pretrained weights), the meta build and materialisation, the
tensor-parallel plans, sharding, what a rank holds, and the record of a prepared model.

This package is the orchestration above the layers: it calls into ``moe``, ``pipeline``, ``fp8``, ``hf`` and
``parallel``; none of them imports it back (tests/unit/test_layering.py).
"""
