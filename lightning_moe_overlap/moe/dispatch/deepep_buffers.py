"""``DeepEPBuffers``: the DeepEP communication buffers of one process, shared by every flex dispatcher.

A ``deep_ep.Buffer`` holds hundreds of MB of NVLink (and RDMA) memory, registered with every peer of its group
when it is built (a collective). Megatron keeps one per process (a module-level cache in ``fused_a2a.py``) and
rebuilds it only when a layer needs more room. Here the same cache has an explicit owner:
:func:`~lightning_moe_overlap.moe.ep.apply_expert_parallel` creates one ``DeepEPBuffers`` and hands it to
the flex dispatcher of every MoE layer it wraps, so a model of N MoE layers builds one buffer, not N.

- One buffer per process group (the ep group; a model uses one).
- Sized for the largest ``hidden_bytes`` (bytes of one token row on the wire) asked for so far; a wider layer
  makes it build a larger one, which replaces the old one for later calls (calls in flight keep theirs).
- ``wire_dtype``: the dtype the buffer's kernels take. DeepEP's normal (intranode and internode) kernels move
  bfloat16 activations only, so the flex dispatcher casts tokens to it around dispatch and combine and back to
  the caller's dtype afterwards. ``None`` keeps the caller's dtype (test doubles that take any dtype).

Building a buffer needs ``deep_ep`` and CUDA (imported lazily); a ``buffer_factory`` replaces that (a test
double, or a buffer shared with other code).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed import ProcessGroup

from lightning_moe_overlap._install import install_hint

BufferFactory = Callable[[ProcessGroup | None, int], Any]
INSTALL_HINT = install_hint("deepep")


def require_flex_backend() -> Any:
    """Import and return ``deep_ep``, or raise ``ImportError`` naming what is missing and how to get it."""
    try:
        deep_ep = importlib.import_module("deep_ep")
    except ImportError as err:
        raise ImportError(
            "dispatcher='flex' needs the DeepEP package (`deep_ep`), which is not installed. Install it with "
            f"{INSTALL_HINT} on a CUDA machine (Hopper GPUs with NVLink/RDMA), or use dispatcher='alltoall'."
        ) from err
    except Exception as err:  # its import checks its NCCL library (an assertion) and sets up its JIT
        raise ImportError(
            f"dispatcher='flex': the DeepEP package (`deep_ep`) is installed but its import failed "
            f"({type(err).__name__}: {err}). DeepEP checks at import that it was built against the NCCL library "
            f"torch loads, and sets up its kernels' compilation: reinstall it for this torch and CUDA with "
            f"{INSTALL_HINT}, or use dispatcher='alltoall'."
        ) from err
    if not torch.cuda.is_available():
        raise ImportError(
            "dispatcher='flex' needs CUDA: DeepEP's kernels run on Hopper GPUs over NVLink/RDMA, but no CUDA device "
            "is available. Run on such a machine, or use dispatcher='alltoall' (runs everywhere, gloo included)."
        )
    return deep_ep


def index_dtype(deep_ep: Any) -> torch.dtype:
    """The dtype of DeepEP's top-k expert indices: ``deep_ep.topk_idx_t`` (a build option of DeepEP), int64 where a
    build does not say."""
    dtype = getattr(deep_ep, "topk_idx_t", None)
    return dtype if isinstance(dtype, torch.dtype) else torch.int64


def check_num_sms(num_sms: object, *, owner: str) -> None:
    """Raise ``ValueError`` unless ``num_sms`` is a positive even int (DeepEP pairs its SMs)."""
    if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 2 or num_sms % 2:
        raise ValueError(
            f"{owner}: deepep_num_sms={num_sms!r} must be a positive even integer (DeepEP splits its SMs into "
            "send/receive pairs); 20-24 is usual on H100/H200."
        )


def build_deepep_buffer(group: ProcessGroup | None, hidden_bytes: int, num_sms: int) -> Any:
    """A ``deep_ep.Buffer`` on ``group`` sized for ``hidden_bytes`` per token, as DeepEP's own examples size it."""
    if group is None:
        raise ValueError(
            "`DeepEPBuffers`: group=None; DeepEP builds its buffer on a process group. Pass the expert-parallel "
            "group (ParallelGroups.ep)."
        )
    buffer_cls = require_flex_backend().Buffer
    buffer_cls.set_num_sms(num_sms)
    size = group.size()
    nvl_bytes = rdma_bytes = 0
    for config in (buffer_cls.get_dispatch_config(size), buffer_cls.get_combine_config(size)):
        nvl_bytes = max(nvl_bytes, config.get_nvl_buffer_size_hint(hidden_bytes, size))
        rdma_bytes = max(rdma_bytes, config.get_rdma_buffer_size_hint(hidden_bytes, size))
    return buffer_cls(group, nvl_bytes, rdma_bytes)


class DeepEPBuffers:
    """The DeepEP buffers of one process: one per group, grown to the widest token row asked for.

    Args:
        num_sms: SMs DeepEP's kernels may use (``Buffer.set_num_sms``, even).
        wire_dtype: dtype of the activations the buffer's kernels take (DeepEP: ``torch.bfloat16``); ``None``
            sends the caller's dtype unchanged.
        buffer_factory: ``(group, hidden_bytes) -> buffer`` to use instead of building a ``deep_ep.Buffer``.
    """

    def __init__(
        self,
        num_sms: int = 20,
        *,
        wire_dtype: torch.dtype | None = torch.bfloat16,
        buffer_factory: BufferFactory | None = None,
    ) -> None:
        check_num_sms(num_sms, owner="`DeepEPBuffers`")
        if wire_dtype is not None and not isinstance(wire_dtype, torch.dtype):
            raise TypeError(
                f"`DeepEPBuffers`: wire_dtype={wire_dtype!r} is not a torch.dtype; pass torch.bfloat16 (what "
                "DeepEP's kernels take) or None to send the caller's dtype."
            )
        self.num_sms = num_sms
        self.wire_dtype = wire_dtype
        self._factory = buffer_factory
        self._buffers: dict[ProcessGroup | None, tuple[Any, int]] = {}
        self.num_built = 0  # buffers built so far (one per group, plus one per growth)

    @property
    def builds_deepep(self) -> bool:
        """True when this provider builds real ``deep_ep.Buffer`` objects (needs DeepEP, CUDA and a group)."""
        return self._factory is None

    def row_bytes(self, hidden_size: int, dtype: torch.dtype) -> int:
        """Bytes of one token row on the wire (DeepEP sizes its buffers for at least 2 bytes per element)."""
        wire = self.wire_dtype or dtype
        return hidden_size * max(torch.empty((), dtype=wire).element_size(), 2)

    def get(self, group: ProcessGroup | None, hidden_bytes: int) -> Any:
        """The buffer of ``group``, built on first use and rebuilt larger when ``hidden_bytes`` exceeds its size.

        Every rank of ``group`` must ask for the same sizes in the same order (they run the same layers), since
        building a DeepEP buffer is a collective.
        """
        buffer, size = self._buffers.get(group, (None, 0))
        if buffer is None or hidden_bytes > size:
            factory = self._factory or (lambda g, nbytes: build_deepep_buffer(g, nbytes, self.num_sms))
            buffer, size = factory(group, hidden_bytes), hidden_bytes
            self._buffers[group] = (buffer, size)
            self.num_built += 1
        return buffer

    def __repr__(self) -> str:
        return (
            f"DeepEPBuffers(num_sms={self.num_sms}, wire_dtype={self.wire_dtype}, groups={len(self._buffers)}, "
            f"num_built={self.num_built})"
        )
