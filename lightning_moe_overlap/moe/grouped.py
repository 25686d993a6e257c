"""Grouped expert GEMMs with a weight-gradient that can be deferred to a comm point.

Rows arrive sorted by expert (``tokens_per_expert[e]`` rows for expert ``e``, in order), or in segments of one
expert each (:meth:`RowSplits.from_segments`, the loop kernels). Each projection is one
autograd function, :class:`GroupedLinear`, whose backward computes the input gradient (dgrad) at once and hands
the weight gradient (wgrad) to ``runtime.defer_wgrad``. When the runtime defers it, the closure runs later, at
a comm point while an all-to-all is in flight, and accumulates into the parameter's ``.grad`` itself; otherwise
backward returns it and autograd accumulates it. Both paths run the same kernels in the same order, so ``.grad``
is bitwise equal. The parameter is the weight when it is a leaf, or the ``grad_target`` the caller names when the
kernel runs on a view of it: the expert-parallel experts pass the local shard of a ``DTensor`` parameter
(``to_local()``, not a leaf) and the ``DTensor`` itself, whose local gradient then receives the deferred sum.

Kernels: ``torch._grouped_mm`` where this torch build supports it (CPU: torch >= 2.9, float32/bfloat16/float16;
CUDA: bfloat16 on compute capability >= 8.0 with torch >= 2.9, Hopper before), with 16-byte aligned rows;
otherwise a loop of one matmul per expert, or per segment (the reference, the float64 path, and rows in
segments).

Row counts: a host list or a device tensor ``counts_e`` (:class:`RowSplits`). The grouped kernel reads int32
end offsets on the device (``cumsum`` of the counts), built once per :func:`grouped_mlp` call and shared by the
forward, dgrad and wgrad GEMMs of both projections: from a device tensor without any host sync, from a host list
with one host-to-device copy (``non_blocking``; no device sync). The loop reads host sizes; from a device tensor
that is one ``tolist`` (a D2H sync, on the reference path only).

Kernels of a projection: :class:`GroupedLinear` by default; a :data:`ProjectionKernel` passed as ``kernel`` (the
experts' ``kernel`` attribute) replaces it, with the same arguments and the same wgrad contract: the FP8 experts
(``lightning_moe_overlap/fp8/experts_kernel.py``) are plugged in this way.

Autocast: under ``torch.autocast`` for the rows' device type, the rows and the weight are cast to the autocast
dtype in forward (as ``torch.nn.functional.linear`` does) and the GEMMs run in it with autocast off; backward
recasts the saved full-precision weight the same way, whatever autocast state it runs under (Lightning runs
backward outside autocast). The input gradient is returned in the compute dtype (autograd casts it to the
input's dtype); the weight gradient is cast to the parameter's dtype before it is returned or accumulated.

Shape legend:
    R: rows (routed assignments) sorted by expert     e: experts held here     D: hidden size
    F: expert ffn size (``2F`` for the fused gate/up projection)               I, O: a projection's in/out size
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import Tensor

from lightning_moe_overlap._compat import torch as torch_compat
from lightning_moe_overlap.overlap.backward_handoff import backward_handoff
from lightning_moe_overlap.overlap.runtime import CommRuntime
from lightning_moe_overlap.parallel.dtensors import like, local

GemmImpl = Literal["auto", "grouped_mm", "loop"]
# `GroupedLinear.apply`'s arguments: (x_RI, weight, splits, transposed, impl, runtime, grad_target) -> y_RO.
ProjectionKernel = Callable[[Tensor, Tensor, "RowSplits", bool, str, CommRuntime | None, tuple[Tensor, ...]], Tensor]
GEMM_IMPLS: tuple[str, ...] = ("auto", "grouped_mm", "loop")
_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TORCH_2_9 = torch.__version__ >= "2.9"  # compared once: a version comparison parses both strings each time


def grouped_mm_supported(x_RI: Tensor, weight_eOI: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` can run this projection (and its backward) in this torch build."""
    if not torch_compat.grouped_mm_available() or x_RI.shape[0] == 0 or weight_eOI.dtype != x_RI.dtype:
        return False
    device = weight_eOI.device
    if device.type == "cpu":
        if not _TORCH_2_9 or x_RI.dtype not in _GROUPED_MM_DTYPES:  # no CPU kernel before 2.9
            return False
    elif device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if x_RI.dtype != torch.bfloat16:
            return False
        if not (capability >= (8, 0) if _TORCH_2_9 else capability[0] == 9):
            return False
    else:
        return False
    per_16_bytes = 16 // x_RI.element_size()
    return weight_eOI.data_ptr() % 16 == 0 and all(size % per_16_bytes == 0 for size in weight_eOI.shape[1:])


def _aligned(t: Tensor) -> Tensor:
    """Contiguous with a 16-byte aligned start, as the grouped kernel requires."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


class RowSplits:
    """Rows per expert, as the kernels read them: host sizes (the loop) and device end offsets (grouped).

    Built once per :func:`grouped_mlp` call from a host list or a device tensor of counts, and shared by the
    forward, dgrad and wgrad GEMMs of both projections: each form is derived once, on first use, and kept.

    Segments: :meth:`from_segments` describes rows that are not sorted by expert but come in segments, each of one
    expert, experts repeating (the all-to-all's receive layout, source rank by source rank). Only the loop kernels
    run them, one matmul per segment on a view of its expert's weight, so no permutation of the rows is needed; the
    weight gradient of an expert sums its segments' products.

    Padded: :meth:`padded` describes sorted rows followed by a tail of padding rows that belong to no expert (the
    static dispatch's empty slots, ``dispatch/static_slots.py``); the kernels never read the tail and leave its
    output rows unwritten.
    """

    __slots__ = ("_counts", "_offsets", "_segments", "_sizes", "num_experts", "padded_tail")

    def __init__(self, tokens_per_expert: Sequence[int] | Tensor) -> None:
        self._sizes: tuple[int, ...] | None = None
        self._counts: Tensor | None = None
        self._offsets: Tensor | None = None
        self._segments: tuple[tuple[int, int], ...] | None = None  # (expert, rows) in row order; None: sorted
        self.padded_tail = False  # rows beyond the counts' sum are padding (`padded`)
        if isinstance(tokens_per_expert, Tensor):
            self._counts = tokens_per_expert.reshape(-1)
            self.num_experts = self._counts.numel()
        else:
            self._sizes = tuple(int(n) for n in tokens_per_expert)
            self.num_experts = len(self._sizes)

    @classmethod
    def of(cls, tokens_per_expert: Sequence[int] | Tensor | RowSplits) -> RowSplits:
        """``tokens_per_expert`` itself when it is a :class:`RowSplits` (e.g. a dispatcher's segments), else its
        splits."""
        return tokens_per_expert if isinstance(tokens_per_expert, RowSplits) else cls(tokens_per_expert)

    @classmethod
    def from_segments(cls, experts: Sequence[int], sizes: Sequence[int], num_experts: int) -> RowSplits:
        """Rows in segments: ``sizes[i]`` rows of expert ``experts[i]``, in this order (experts may repeat)."""
        if len(experts) != len(sizes) or any(not 0 <= e < num_experts for e in experts):
            raise ValueError(
                f"RowSplits.from_segments: experts {list(experts)} and sizes {list(sizes)} with {num_experts} experts; "
                f"the rule is one expert in [0, {num_experts}) per segment size. Pass an expert index in that range "
                "for each size."
            )
        totals = [0] * num_experts
        for e, n in zip(experts, sizes):
            totals[e] += n
        splits = cls(totals)
        splits._segments = tuple((int(e), int(n)) for e, n in zip(experts, sizes) if n)
        return splits

    @classmethod
    def padded(cls, counts_e: Tensor) -> RowSplits:
        """Rows sorted by expert (``counts_e``, on the device), then padding rows up to the end."""
        splits = cls(counts_e)
        splits.padded_tail = True
        return splits

    @property
    def sorted(self) -> bool:
        """Whether the rows are sorted by expert (else they come in segments: the loop kernels only)."""
        return self._segments is None

    @property
    def on_host(self) -> bool:
        """Whether the sizes were given on the host (then they can be validated without a sync)."""
        return self._sizes is not None

    def host_sizes(self) -> tuple[int, ...]:
        """The rows of each expert, on the host: its row count in the sorted layout, its total over segments."""
        if self._sizes is None:
            assert self._counts is not None
            self._sizes = tuple(self._counts.tolist())  # NOTE: D2H sync (loop path only: the reference)
        return self._sizes

    def segments(self) -> tuple[tuple[int, int], ...]:
        """``(expert, rows)`` of each run of rows of one expert, in row order, empty runs left out."""
        if self._segments is None:
            self._segments = tuple((e, n) for e, n in enumerate(self.host_sizes()) if n)
        return self._segments

    def sorted_rows(self) -> RowSplits:
        """These splits, required to be sorted by expert (a kernel that reads per-expert sizes or offsets)."""
        experts = [e for e, _ in self._segments or ()]
        if any(a >= b for a, b in zip(experts, experts[1:])):  # each expert at most once, in increasing order
            raise ValueError(
                f"RowSplits: the rows come in segments of experts {experts}, not sorted by "
                "expert, and this kernel needs them sorted. Pass rows sorted by expert (the all-to-all dispatcher "
                "sorts them on CUDA), or use expert_backend='torch', whose kernels read segments."
            )
        return self

    def device_offsets(self, device: torch.device) -> Tensor:
        """int32 end offsets ``cumsum(counts)`` on ``device``, as ``torch._grouped_mm`` reads them (sorted rows)."""
        if self._offsets is None:
            if self._counts is not None:  # on the device already: no host round trip
                self._offsets = torch.cumsum(self._counts, 0, dtype=torch.int32)
            else:  # summed on the host, one host-to-device copy (pageable: staged at once, no device sync)
                ends = torch.tensor(list(itertools.accumulate(self._sizes)), dtype=torch.int32)
                self._offsets = ends.to(device, non_blocking=True)
        return self._offsets

    def counts_on(self, device: torch.device) -> Tensor:
        """The counts as an int64 tensor on ``device`` (``repeat_interleave`` of per-expert biases)."""
        if self._counts is None:  # one host-to-device copy, shared with the offsets built after it
            self._counts = torch.tensor(self._sizes, dtype=torch.int64).to(device, non_blocking=True)
        return self._counts.to(torch.int64)

    def bias_rows(self, bias_eO: Tensor, num_rows: int) -> Tensor:
        """Each row's expert bias: ``[R, O]`` from ``[e, O]``."""
        if self._segments is None:
            repeats = self.counts_on(bias_eO.device)
            if self.padded_tail:  # the tail gets a zero bias row: one more "expert", the padding
                repeats = torch.cat([repeats, (num_rows - repeats.sum()).view(1)])
                bias_eO = torch.cat([bias_eO, bias_eO.new_zeros(1, bias_eO.shape[-1])])
            return torch.repeat_interleave(bias_eO, repeats, dim=0, output_size=num_rows)
        experts, sizes = zip(*self._segments) if self._segments else ((), ())
        index = torch.tensor(experts, dtype=torch.int64).to(bias_eO.device, non_blocking=True)
        repeats = torch.tensor(sizes, dtype=torch.int64).to(bias_eO.device, non_blocking=True)
        return torch.repeat_interleave(bias_eO.index_select(0, index), repeats, dim=0, output_size=num_rows)


def autocast_dtype(t: Tensor) -> torch.dtype | None:
    """The dtype autocast would cast ``t`` to for a matmul here, or None (autocast off, or not eligible)."""
    device_type = t.device.type
    if not torch.is_autocast_enabled(device_type) or not t.is_floating_point() or t.dtype == torch.float64:
        return None
    return torch.get_autocast_dtype(device_type)


def _cast(t: Tensor, dtype: torch.dtype | None) -> Tensor:
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


def _use_grouped_mm(impl: str, x_RI: Tensor, weight: Tensor, splits: RowSplits) -> bool:
    return impl != "loop" and splits.sorted and grouped_mm_supported(x_RI, weight)


def _loop_mm(x_RI: Tensor, w_eIO: Tensor, splits: RowSplits) -> Tensor:
    """``y_s = x_s @ w[e_s]`` per segment ``s``, written in place into one ``[R, O]`` output (no concatenation)."""
    out = x_RI.new_empty(x_RI.shape[0], w_eIO.shape[-1])
    start = 0
    for e, n in splits.segments():
        torch.mm(x_RI[start : start + n], w_eIO[e], out=out[start : start + n])
        start += n
    return out


def _forward(x_RI: Tensor, weight: Tensor, splits: RowSplits, transposed: bool, grouped: bool) -> Tensor:
    """``y_e = x_e @ W_e^T`` for weights stored ``[e, O, I]``; ``y_e = x_e @ W_e`` for ``[e, I, O]``."""
    w = weight if transposed else weight.transpose(-2, -1)  # [e, I, O]
    if grouped:
        return torch_compat.grouped_mm(x_RI, w, offs=splits.device_offsets(x_RI.device))
    return _loop_mm(x_RI, w, splits)


def _dgrad(g_RO: Tensor, weight: Tensor, splits: RowSplits, transposed: bool, grouped: bool) -> Tensor:
    w = weight.transpose(-2, -1) if transposed else weight  # [e, O, I]
    if grouped:
        return torch_compat.grouped_mm(g_RO, w, offs=splits.device_offsets(g_RO.device))
    return _loop_mm(g_RO, w, splits)


def _wgrad(x_RI: Tensor, g_RO: Tensor, splits: RowSplits, transposed: bool, grouped: bool) -> Tensor:
    """``dW_e = g_e^T x_e`` (``[e, O, I]``) or ``x_e^T g_e`` (``[e, I, O]``); zero for experts with no rows.

    The loop sums an expert's segments in row order (its first product written, the others added)."""
    a, b = (x_RI, g_RO) if transposed else (g_RO, x_RI)
    if grouped:
        return torch_compat.grouped_mm(a.t(), b, offs=splits.device_offsets(a.device))
    dw = a.new_empty(splits.num_experts, a.shape[-1], b.shape[-1])
    written = [False] * splits.num_experts
    start = 0
    for e, n in splits.segments():
        a_s, b_s = a[start : start + n], b[start : start + n]
        if written[e]:
            dw[e].addmm_(a_s.t(), b_s)
        else:
            torch.mm(a_s.t(), b_s, out=dw[e])
            written[e] = True
        start += n
    for e in (e for e, done in enumerate(written) if not done):
        dw[e].zero_()
    return dw


class GroupedLinear(torch.autograd.Function):
    """One bias-free projection per expert over rows sorted by expert, with a deferrable weight gradient."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        x_RI: Tensor,
        weight: Tensor,
        splits: RowSplits,
        transposed: bool,
        impl: str,
        runtime: CommRuntime | None,
        grad_target: tuple[Tensor, ...] = (),
    ) -> Tensor:
        dtype = autocast_dtype(x_RI)  # the compute dtype under autocast; None keeps the inputs' dtypes
        x_RI, w = _cast(x_RI, dtype), _cast(weight, dtype)
        grouped = _use_grouped_mm(impl, x_RI, w, splits)
        if grouped:
            x_RI = _aligned(x_RI)
        # The full-precision weight is saved (backward recasts it): no second copy of the experts per micro-batch.
        ctx.save_for_backward(x_RI, weight)
        ctx.splits, ctx.transposed, ctx.grouped, ctx.runtime, ctx.dtype = splits, transposed, grouped, runtime, dtype
        # The accumulation target of a deferred wgrad. Not taken from `saved_tensors`: under non-reentrant
        # checkpointing those are detached recomputed aliases, whose `.grad` is not the parameter's.
        ctx.leaf_weight = leaf_target(weight, grad_target)
        with torch.autocast(x_RI.device.type, enabled=False):
            return _forward(x_RI, w, splits, transposed, grouped)

    @staticmethod
    def backward(ctx, g_RO: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x_RI, weight = ctx.saved_tensors
        splits, transposed, grouped = ctx.splits, ctx.transposed, ctx.grouped
        g_RO = _cast(g_RO, x_RI.dtype)
        g_RO = _aligned(g_RO) if grouped else g_RO.contiguous()
        device_type = g_RO.device.type
        dx = None
        if ctx.needs_input_grad[0]:
            with torch.autocast(device_type, enabled=False):
                dx = _dgrad(g_RO, _cast(weight, ctx.dtype), splits, transposed, grouped)
        if not ctx.needs_input_grad[1]:
            return dx, None, None, None, None, None, None

        dw = weight_gradient(ctx.leaf_weight, ctx.runtime, device_type, weight.dtype,
                             lambda: _wgrad(x_RI, g_RO, splits, transposed, grouped))  # fmt: skip
        return dx, dw, None, None, None, None, None


def weight_gradient(
    target: Tensor | None,
    runtime: CommRuntime | None,
    device_type: str,
    dtype: torch.dtype,
    compute: Callable[[], Tensor],
) -> Tensor | None:
    """A grouped GEMM's weight gradient (``compute()``, cast to ``dtype``): handed to ``runtime.defer_wgrad``, which
    runs it at a later comm point accumulating into ``target.grad`` (returns None: nothing for autograd), or
    computed now and returned. Only a leaf parameter has a ``.grad`` the closure may write; without one (``target``
    None: a view or a cast of a weight that names no ``grad_target``, :func:`leaf_target`) it is computed now."""

    def now() -> Tensor:
        with torch.autocast(device_type, enabled=False):
            return compute().to(dtype)

    @torch.no_grad()  # it may run at a comm point where the caller's grad mode is on
    def accumulate() -> None:
        dw = now()
        if target.grad is None:
            target.grad = like(target, dw)  # a DTensor parameter's gradient is a DTensor of the same layout
        else:
            local(target.grad).add_(dw)

    if target is not None and runtime is not None and runtime.defer_wgrad(accumulate):
        return None
    return now()


def leaf_target(weight: Tensor, grad_target: tuple[Tensor, ...]) -> Tensor | None:
    """The leaf whose ``.grad`` a deferred wgrad of ``weight`` accumulates into, or None (the inline path).

    ``grad_target`` is ``()`` (the weight itself) or ``(parameter,)`` where ``weight`` is ``local(parameter)``: a
    ``DTensor``'s ``to_local()`` is not a leaf, but its parameter is.
    """
    target = grad_target[0] if grad_target else weight
    if not (target.is_leaf and target.requires_grad):
        return None
    shard = local(target)
    if shard.shape != weight.shape or shard.dtype != weight.dtype:
        raise ValueError(
            f"`GroupedLinear`: grad_target has a local shard of shape {tuple(shard.shape)} and dtype {shard.dtype}, "
            f"but the weight is {tuple(weight.shape)} {weight.dtype}; the rule is weight == local(grad_target). "
            "Pass the parameter whose local shard the kernel runs on, or no grad_target."
        )
    return target


def grouped_linear(
    x_RI: Tensor,
    weight: Tensor,
    tokens_per_expert: Sequence[int] | Tensor | RowSplits,
    *,
    transposed: bool = False,
    runtime: CommRuntime | None = None,
    impl: GemmImpl = "auto",
) -> Tensor:
    """Apply expert ``e``'s weight to its ``tokens_per_expert[e]`` rows (a host list, a device tensor, or the
    :class:`RowSplits` of rows in segments)."""
    return GroupedLinear.apply(x_RI, weight, RowSplits.of(tokens_per_expert), transposed, impl, runtime)


def row_splits(
    tokens_per_expert: Sequence[int] | Tensor | RowSplits, num_experts: int, num_rows: int, owner: str
) -> RowSplits:
    """The rows per expert of one call, checked against the weights' experts and the rows (a device tensor is not
    summed: no host sync). A :class:`RowSplits` (e.g. a dispatcher's segments) is checked and passed through."""
    splits = RowSplits.of(tokens_per_expert)
    total = sum(splits.host_sizes()) if splits.on_host else None
    if splits.num_experts != num_experts or total not in (None, num_rows):
        summing = "" if total is None else f" summing to {total}"
        raise ValueError(
            f"{owner}: tokens_per_expert has {splits.num_experts} entries{summing}, but there are {num_experts} "
            f"experts and {num_rows} rows; the rule is one count per expert, summing to the number of rows. Pass the "
            "counts the dispatcher returned with these rows."
        )
    return splits


def grouped_projection(
    x_RI: Tensor,
    weight: Tensor,
    splits: RowSplits,
    *,
    bias: Tensor | None = None,
    transposed: bool = False,
    runtime: CommRuntime | None = None,
    impl: GemmImpl = "auto",
    grad_target: Tensor | None = None,
    kernel: ProjectionKernel | None = None,
) -> Tensor:
    """One projection of every expert (the first, ``fc1``, or the down projection, ``fc2``), plus its optional
    ``[e, O]`` per-expert bias. ``grad_target``: the parameter whose local shard ``weight`` is (a ``DTensor``), where
    a deferred weight gradient accumulates; ``None`` when ``weight`` is the parameter itself. ``kernel``: replaces
    :class:`GroupedLinear` (e.g. the FP8 experts' kernel); ``None`` keeps it."""
    target = () if grad_target is None else (grad_target,)  # in a tuple: not an input of the autograd function
    apply = GroupedLinear.apply if kernel is None else kernel
    y_RO = apply(x_RI, weight, splits, transposed, impl, runtime, target)
    if bias is not None:
        y_RO = y_RO + splits.bias_rows(bias, x_RI.shape[0])
    return y_RO


def gated_activation(h_RF2: Tensor, act_fn: Callable[[Tensor], Tensor]) -> Tensor:
    """``act(gate) * up`` with the fused projection laid out ``[gate; up]`` along the last dim."""
    gate, up = h_RF2.chunk(2, dim=-1)
    return act_fn(gate) * up


def check_impl(impl: str, owner: str) -> None:
    """``ValueError`` for a GEMM implementation that is not one of :data:`GEMM_IMPLS`."""
    if impl not in GEMM_IMPLS:
        raise ValueError(f"{owner}: impl={impl!r} is not one of {list(GEMM_IMPLS)}; pick one of those.")


def check_activation(
    act_fn: Callable[[Tensor], Tensor] | None, gate_fn: Callable[[Tensor], Tensor] | None, owner: str
) -> None:
    """``ValueError`` when neither ``act_fn`` nor ``gate_fn`` is given: nothing would compute the activation."""
    if act_fn is None and gate_fn is None:
        raise ValueError(
            f"{owner}: act_fn=None and gate_fn=None; one of them must compute the experts' activation. Give the "
            "element-wise activation (`act_fn`), or a `gate_fn` for a custom gating."
        )


def expert_activation(
    h_RF2: Tensor,
    act_fn: Callable[[Tensor], Tensor] | None,
    *,
    gate_fn: Callable[[Tensor], Tensor] | None = None,
    gated: bool = True,
) -> Tensor:
    """The activation stage on the first projection's output: ``gate_fn(h)``, ``act(gate) * up``, or ``act(h)``
    with ``gated=False`` (one of ``act_fn``, ``gate_fn`` is set: :func:`check_activation`)."""
    if gate_fn is not None:
        return gate_fn(h_RF2)
    assert act_fn is not None
    return gated_activation(h_RF2, act_fn) if gated else act_fn(h_RF2)


def grouped_mlp(
    x_RD: Tensor,
    tokens_per_expert: Sequence[int] | Tensor | RowSplits,
    gate_up_eFD: Tensor,
    down_eDF: Tensor,
    act_fn: Callable[[Tensor], Tensor] | None,
    runtime: CommRuntime | None = None,
    *,
    transposed: bool = False,
    gate_up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
    gate_fn: Callable[[Tensor], Tensor] | None = None,
    gated: bool = True,
    impl: GemmImpl = "auto",
    backward_handoffs: int = 0,
    kernel: ProjectionKernel | None = None,
) -> Tensor:
    """Expert MLP ``down(act(gate) * up)`` over rows sorted by (local) expert, or in segments of one expert each.

    Args:
        x_RD: rows sorted by expert (or in the segments of a :class:`RowSplits`).
        tokens_per_expert: row count per expert (``sum == R``), one entry per weight slice: a host list, or an
            integer tensor on the rows' device (the grouped kernel then needs no host sync; the sum is not checked);
            or a :class:`RowSplits`, e.g. a dispatcher's rows in segments (:meth:`RowSplits.from_segments`).
        gate_up_eFD: fused gate/up weights ``[e, 2F, D]`` (or ``[e, D, 2F]`` with ``transposed``); with
            ``gated=False`` the plain up projection ``[e, F, D]``.
        down_eDF: down projection ``[e, D, F]`` (or ``[e, F, D]`` with ``transposed``).
        act_fn: element-wise activation (unused when ``gate_fn`` is given).
        runtime: receives the deferred weight-gradient GEMMs; ``None`` computes them inline.
        transposed: weights stored ``[e, in, out]`` instead of ``[e, out, in]``.
        gate_up_bias: optional ``[e, 2F]`` bias of the first projection.
        down_bias: optional ``[e, D]`` bias of the down projection.
        gate_fn: replaces the default gating ``act(gate) * up`` (e.g. an interleaved or clamped variant); maps
            the first projection's output ``[R, 2F]`` to ``[R, F]``.
        gated: ``False`` for experts without a gate: ``down(act(up(x)))``.
        impl: ``"auto"`` (grouped GEMM where supported, else the loop), ``"grouped_mm"`` (same fallback), or
            ``"loop"`` (one matmul per expert; the reference).
        backward_handoffs: hand-overs (``runtime.handoff()``, nothing in flight) in the backward between the down
            and the first projection's gradients; the dispatcher's ``backward_handoffs``, which balance the
            forward's comm points that have no backward twin (``docs/overlap.md``, "Balanced hand-overs").
        kernel: the projections' kernel in place of :class:`GroupedLinear` (:data:`ProjectionKernel`, e.g. FP8).

    Returns:
        ``y_RD``, rows in the same order as ``x_RD``.

    The expert-parallel experts run the same three stages as modules (``fc1``, ``act``, ``fc2``; see
    :class:`~lightning_moe_overlap.moe.ep.ExpertParallelExperts`).
    """
    owner = "`grouped_mlp`"
    check_impl(impl, owner)
    check_activation(act_fn, gate_fn, owner)
    splits = row_splits(tokens_per_expert, gate_up_eFD.shape[0], x_RD.shape[0], owner)
    h = grouped_projection(
        x_RD, gate_up_eFD, splits, bias=gate_up_bias, transposed=transposed, runtime=runtime, impl=impl, kernel=kernel
    )
    h = expert_activation(h, act_fn, gate_fn=gate_fn, gated=gated)
    h = backward_handoff(h, runtime, backward_handoffs)
    return grouped_projection(
        h, down_eDF, splits, bias=down_bias, transposed=transposed, runtime=runtime, impl=impl, kernel=kernel
    )
