"""Context-parallel attention, on for the threads that ask for it: torch's ring SDPA, entered per thread.

How torch 2.13 hooks attention. ``torch.distributed.tensor.experimental.context_parallel`` sets no
``TorchFunctionMode`` and no dispatch mode; it changes process-wide state, seen by every thread:

1. it monkey-patches the attribute ``torch.nn.functional.scaled_dot_product_attention`` with a wrapper that wraps
   the tensor arguments as ``DTensor``s sharded on the sequence (``Shard(2)``) of the cp mesh, calls the original
   and takes the local shards of the outputs (``_ContextParallel.sdpa_input_fn`` / ``sdpa_output_fn``). Only calls
   that look the attribute up at call time go through it (a name imported earlier with ``from
   torch.nn.functional import scaled_dot_product_attention`` keeps the original);
2. it enables its dispatcher: ``DTensor``'s op dispatcher gets handlers for the SDPA ops (the ring, see
   ``context_ring_cpu.py``) and the sharding rules for ``Shard(2)``, in process-wide tables;
3. it sets ``_cp_options.enable_load_balance``, which the ring reads at every forward and backward;
4. it shards the ``buffers`` in place and restores them on exit.

So a second thread sees context parallelism while the context is open on the main thread, but the state is not
re-entrant and not per thread: the first ``context_parallel`` of two to exit restores the original SDPA and removes
the handlers under the other, and every thread that calls SDPA (an evaluation, a monitor) is context-parallel too.
The backward needs nothing on its thread: autograd calls the backward op on ``DTensor``s, which the process-wide
handlers take, whichever thread runs it. A recomputation does: autograd runs backward nodes, and the forward that a
``torch.utils.checkpoint`` recomputes inside one, without the ``TorchFunctionMode`` stack of any thread (not even
of the thread that called ``backward()``), so a mode reaches a recompute only through checkpoint's ``context_fn``.

:class:`ContextParallelAttention` splits the two kinds of state. :meth:`~ContextParallelAttention.enabled` holds
the process-wide part (2, 3 and :func:`install_cpu_ring_attention`) for as long as any forward or backward of
context-parallel attention may run (a whole fit); it only changes what SDPA ops on ``Shard(2)`` ``DTensor``s do,
which no other code makes. :meth:`~ContextParallelAttention.thread_context` returns a context manager that routes
the SDPA calls of the thread that enters it to the ring (a ``TorchFunctionMode``, torch's own wrapping of 1,
thread-local like every mode). Enter it on each thread that runs a forward: the main thread, each lane of the
overlap engine (``context_factory=lambda task: cp.thread_context()``); a checkpointed region takes
``context_fn=cp.checkpoint_contexts`` for its recomputation. Modes nest: a ``thread_context`` inside another passes
the call to the outer one. A thread without one computes ordinary attention on whatever tensors it has. Batches are
sharded by ``context_batch.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.overrides import TorchFunctionMode

from lightning_moe_overlap._compat import torch as torch_compat
from lightning_moe_overlap.parallel.context_ring_cpu import install_cpu_ring_attention

SEQ_DIM = 2  # SDPA's (batch, heads, seq, dim)


class ContextParallelAttention:
    """Torch's ring attention over ``mesh`` (the 1-D cp mesh) for SDPA calls on the threads that enter it.

    Args:
        mesh: the cp dimension of the device mesh (1-D); each rank holds a sequence shard of every batch.
        load_balance: the batches were sharded head-tail (``context_batch.shard_sequence(..., load_balance=True)``,
            torch's balancing of causal attention), so the ring treats each rank's shard as two chunks. Only
            causal attention (``is_causal=True``) runs under it; ``False`` for contiguous shards, any attention.
    """

    def __init__(self, mesh: DeviceMesh, *, load_balance: bool = True) -> None:
        if mesh.ndim != 1:
            raise ValueError(
                f"ContextParallelAttention got a {mesh.ndim}-D mesh {mesh}; the ring runs over one dimension. Pass "
                "the cp dimension of the mesh (for example `mesh['cp']`)."
            )
        self.mesh = mesh
        self.load_balance = load_balance
        self._on = False

    @contextmanager
    def enabled(self) -> Iterator[None]:
        """The process-wide part: torch's context-parallel handlers (with the CPU op's) and its load-balance
        option, for the block. Enter once, on one thread, around every forward and backward it covers."""
        if torch_compat.cp_dispatcher_enabled():
            raise RuntimeError(
                "ContextParallelAttention.enabled(): torch's context-parallel dispatcher is already on (another "
                "`enabled()` or a `torch.distributed.tensor.experimental.context_parallel` block is open); torch's "
                "state is process-wide and not re-entrant, so leaving this block would switch it off under the "
                "other. Enter one of them once, around the whole run."
            )
        install_cpu_ring_attention()
        previous = torch_compat.cp_load_balance()
        torch_compat.set_cp_load_balance(self.load_balance)
        torch_compat.enable_cp_dispatcher(True)
        self._on = True
        try:
            yield
        finally:
            self._on = False
            torch_compat.enable_cp_dispatcher(False)
            torch_compat.set_cp_load_balance(previous)

    def thread_context(self) -> TorchFunctionMode:
        """A fresh context manager routing this thread's ``F.scaled_dot_product_attention`` calls to the ring
        (inside :meth:`enabled`). Enter one per thread; a thread sees only the modes it entered itself."""
        return _RingSDPAMode(self)

    def checkpoint_contexts(self) -> tuple[TorchFunctionMode, TorchFunctionMode]:
        """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False, context_fn=...)``: a
        :meth:`thread_context` for the checkpointed forward and one for its recomputation, which runs inside the
        backward, where no mode of any thread is seen."""
        return self.thread_context(), self.thread_context()

    def _is_ring_input(self, args: tuple, kwargs: dict) -> bool:
        """The call's query is already this mesh's ``Shard(2)`` DTensor: an enclosing ring mode wrapped it."""
        query = args[0] if args else kwargs.get("query")
        return (
            isinstance(query, DTensor) and query.device_mesh == self.mesh and query.placements == (Shard(SEQ_DIM),)
        )

    def _ring_sdpa(self, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """One SDPA call: local ``(B, H, S, D)`` shards in, this rank's shard of the attention out."""
        if not self._on:
            raise RuntimeError(
                "scaled_dot_product_attention ran under ContextParallelAttention.thread_context() outside "
                "`ContextParallelAttention.enabled()`: the ring handlers are not installed, so the attention would "
                "see only this rank's keys. Enter `enabled()` (once, on the main thread) around the forward and the "
                "backward."
            )
        _check_call(args, kwargs, self.load_balance)
        wrap_inputs, unwrap_outputs = torch_compat.cp_sdpa_wrappers(SEQ_DIM)
        args, kwargs = wrap_inputs(None, args, kwargs, self.mesh)
        return unwrap_outputs(None, (args, kwargs), func(*args, **kwargs), self.mesh)


class _RingSDPAMode(TorchFunctionMode):
    """Runs ``F.scaled_dot_product_attention`` calls through :meth:`ContextParallelAttention._ring_sdpa`."""

    def __init__(self, attention: ContextParallelAttention) -> None:
        super().__init__()
        self.attention = attention

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def, override]
        kwargs = kwargs or {}
        # the mode is off inside its own handler; an enclosing ring mode (nested thread_context) passes through
        if func is F.scaled_dot_product_attention and not self.attention._is_ring_input(args, kwargs):
            return self.attention._ring_sdpa(func, args, kwargs)
        return func(*args, **kwargs)


SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


def _check_call(args: tuple, kwargs: dict, load_balance: bool) -> None:
    """Refuse the SDPA calls the ring cannot run, with the fix."""
    call = {**dict(zip(SDPA_ARGS, args)), **kwargs}
    tensors = [call.get(name) for name in ("query", "key", "value")]
    if any(isinstance(t, DTensor) for t in tensors):
        raise NotImplementedError(
            "scaled_dot_product_attention got DTensor query/key/value under context parallelism; the ring takes "
            "this rank's plain (batch, heads, seq, dim) shards. Take tensor-parallel DTensors to local tensors "
            "before attention (`use_local_output=True` in the parallel styles)."
        )
    if call.get("attn_mask") is not None:
        raise NotImplementedError(
            "scaled_dot_product_attention got an attn_mask under context parallelism; the ring attention takes no "
            "mask. Use is_causal=True without a mask (pack or pad sequences to the full length), or run with cp=1."
        )
    if load_balance and not call.get("is_causal", False):
        raise NotImplementedError(
            "scaled_dot_product_attention got is_causal=False under ContextParallelAttention(load_balance=True); the "
            "head-tail shards balance causal attention and torch's ring runs only causal attention on them. Shard "
            "the batch contiguously (`shard_sequence(..., load_balance=False)`) and pass load_balance=False, or "
            "use causal attention."
        )
