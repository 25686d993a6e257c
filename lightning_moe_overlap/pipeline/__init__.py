"""Pipeline parallelism: cutting a model into stage chunks and running them with torch's pipeline schedules.

``config/pipeline_layout.py`` (which layers each chunk holds) and ``split.py`` cut the model (``pp * vpp`` chunks,
each rank building only its own);
``schedules.py`` and the modules next to it run one optimizer step through ``torch.distributed.pipelining``, with
the forward of one chunk's micro-batch overlapped against the backward of another's (``OVERLAP_F_B``).
"""
