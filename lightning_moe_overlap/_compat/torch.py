"""Every private torch name this package uses, in one place (the supported range is pinned in pyproject).

Names are reached through functions, looked up when called, so importing this module never touches CUDA; the one
private method the package extends (``nn.Module._apply``) is extended here, by ``Float32Buffers``.
Each name has a test in ``tests/unit/test_compat_torch.py`` that names the torch version when it fails.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn


def foreach_norm(tensors: Sequence[Tensor], ord: float, *, dtype: torch.dtype | None = None) -> tuple[Tensor, ...]:
    """``torch._foreach_norm``: one fused kernel for the norms of many tensors (same device and dtype)."""
    return torch._foreach_norm(list(tensors), ord, dtype=dtype)


def foreach_mul_(tensors: Sequence[Tensor], scalar: Tensor) -> None:
    """``torch._foreach_mul_`` by a 0-d tensor: scales many tensors in place without reading ``scalar`` back."""
    torch._foreach_mul_(list(tensors), scalar)


def cuda_sleep(cycles: int) -> None:
    """``torch.cuda._sleep``: a kernel that spins the current stream for ``cycles`` GPU clock cycles."""
    torch.cuda._sleep(int(cycles))


def assert_async(condition: Tensor, message: str) -> None:
    """``torch._assert_async``: raise ``message`` where ``condition`` (a one-element tensor) is false, without the
    host waiting for it on CUDA (a device-side assert); on CPU at once, as a ``RuntimeError``."""
    torch._assert_async(condition, message)


def grouped_mm_available() -> bool:
    """Whether this torch build has ``torch._grouped_mm`` (which devices and dtypes it runs is the caller's check)."""
    return hasattr(torch, "_grouped_mm")


def grouped_mm(mat_a: Tensor, mat_b: Tensor, *, offs: Tensor) -> Tensor:
    """``torch._grouped_mm``: one GEMM per group of rows delimited by the int32 end offsets ``offs``.

    Goes through the public ``torch.nn.functional.grouped_mm`` where this torch has it (a thin wrapper of the same
    op), so only older builds reach the private name.
    """
    public = getattr(torch.nn.functional, "grouped_mm", None)
    if public is not None:
        return public(mat_a, mat_b, offs=offs)
    return torch._grouped_mm(mat_a, mat_b, offs=offs)


def scaled_mm(mat_a: Tensor, mat_b: Tensor, *, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``torch._scaled_mm``: ``(mat_a * scale_a) @ (mat_b * scale_b)`` of FP8 operands, in ``out_dtype``.

    ``mat_a`` is row-major, ``mat_b`` column-major; the scales are float32, either 0-d (tensorwise) or ``[M, 1]`` and
    ``[1, N]`` (rowwise). Runs on CPU (checked with torch 2.13, ``float8_e4m3fn`` and ``float8_e5m2``) and on CUDA
    (compute capability >= 8.9, contraction and output dims multiples of 16).

    Some torch versions' CPU kernel takes only per-tensor scales (torch 2.11's: "only supports per-tensor scaling for
    CPU backend"; torch 2.13's takes rowwise ones): where :func:`_cpu_scaled_mm_takes_scale_vectors` finds this
    torch's does not, CPU operands with scale vectors go to :func:`_scaled_mm_reference`, the same product computed
    in float32.
    """
    rowwise = scale_a.numel() != 1 or scale_b.numel() != 1
    if rowwise and mat_a.device.type == "cpu" and not _cpu_scaled_mm_takes_scale_vectors(
        mat_a.dtype, mat_b.dtype, out_dtype
    ):
        return _scaled_mm_reference(mat_a, mat_b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    return torch._scaled_mm(mat_a, mat_b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


def _scaled_mm_reference(
    mat_a: Tensor, mat_b: Tensor, *, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype
) -> Tensor:
    """What ``torch._scaled_mm`` computes, without it: the float32 product of the FP8 values (each FP8 value, and
    each product of two, is exact in float32; the sums are float32 accumulation, as the kernels'), times
    ``scale_a`` (``[M, 1]`` or 0-d) and ``scale_b`` (``[1, N]`` or 0-d) in float32, cast to ``out_dtype`` once."""
    return ((mat_a.float() @ mat_b.float()) * scale_a.float() * scale_b.float()).to(out_dtype)


@functools.cache
def _cpu_scaled_mm_takes_scale_vectors(a_dtype: torch.dtype, b_dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Whether this torch's CPU ``torch._scaled_mm`` takes rowwise scales (``[M, 1]``, ``[1, N]``) for these
    dtypes and computes with them: probed once per process and dtypes on ``[16, 16]`` operands of small integers and
    power-of-two scales, whose scaled product is exact in every dtype here; a kernel that refuses them (raises) or
    returns anything else does not."""
    m, k = torch.arange(16.0).reshape(16, 1), torch.arange(16.0).reshape(1, 16)
    a_MK = ((m + 2 * k).remainder(5) - 2).to(a_dtype)  # in [-2, 2]; no row or column repeats another
    b_KN = ((3 * k + m).remainder(3) - 1).to(b_dtype).t()  # in [-1, 1]; column-major, as the kernel wants
    scale_a = torch.exp2(torch.arange(16, dtype=torch.float32).remainder(3)).reshape(16, 1)
    scale_b = torch.exp2(-torch.arange(16, dtype=torch.float32).remainder(2)).reshape(1, 16)
    try:
        out = torch._scaled_mm(a_MK, b_KN, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    except (RuntimeError, NotImplementedError):  # the refusal is an internal assert: RuntimeError
        return False
    want = _scaled_mm_reference(a_MK, b_KN, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    return out.dtype == out_dtype and torch.equal(out, want)


def current_graph_task_id() -> int:
    """``torch._C._current_graph_task_id``: the id of the backward pass running on this thread, ``-1`` outside one."""
    return torch._C._current_graph_task_id()


def top_saved_tensors_hooks() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """``torch._C._autograd._top_saved_tensors_default_hooks``: the innermost ``(pack, unpack)`` saved-tensor hooks
    of this thread (those of ``torch.autograd.graph.saved_tensors_hooks`` and of ``torch.utils.checkpoint``), or
    ``None`` when none is pushed or this torch cannot tell."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:  # pragma: no cover - older torch
        return None
    return top(False)  # ignore_is_tracing=False


def default_store() -> dist.Store:
    """``torch.distributed.distributed_c10d._get_default_store``: the default process group's c10d store."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def grad_scaler_found_inf(scaler: Any, optimizer: Any) -> list[Tensor]:
    """``GradScaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]``: the flags ``unscale_`` recorded
    for ``optimizer`` (one per device; 1.0 where a gradient was inf/NaN), which ``step`` reads to skip; [] if none."""
    state = scaler._per_optimizer_states.get(id(optimizer), {})
    return list(state.get("found_inf_per_device", {}).values())


def gloo_options() -> Any:
    """``ProcessGroupGloo._Options()``: a gloo group's options (to carry a timeout into ``init_device_mesh``'s
    ``backend_override``; torch exposes no public constructor for them)."""
    return dist.ProcessGroupGloo._Options()


def set_options_timeout(options: Any, timeout: Any) -> Any:
    """``Backend.Options._timeout``: the timeout of the group made with ``options`` (``init_device_mesh`` reads it
    there); returns ``options``."""
    options._timeout = timeout
    return options


def flatten_mesh(mesh: Any, name: str, backend_override: Any = None) -> Any:
    """``DeviceMesh._flatten``: a 1-D view of the dimensions of ``mesh`` (a slice of a root mesh), registered on the
    root under ``name`` so that ``root[name]`` returns it; the ranks keep their row-major order. ``backend_override``:
    ``(backend, options)`` of the new group, as ``init_device_mesh`` takes per dimension."""
    return mesh._flatten(name, backend_override=backend_override)


def fsdp_lazy_init(module: nn.Module) -> None:
    """``FSDPState._lazy_init`` of the module ``fully_shard`` was applied to: what its first forward would do (mark
    it the root, set up its communication context); for a root whose own forward may never run (a LightningModule
    whose ``training_step`` calls submodules)."""
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415 - FSDP2 only where a model is sharded

    fully_shard.state(module)._lazy_init()


def fsdp_reduce_gradients(module: nn.Module) -> None:
    """Run the gradient reduction that ``fully_shard`` defers with ``set_requires_gradient_sync(False)``: each FSDP
    param group's ``post_backward()`` under ``module`` and the root's ``_root_post_backward_final_callback()``, as
    torch's pipelining does after the last backward (``_PipelineStageBase.perform_reduce_grad``). The caller sets
    gradient sync and resharding back on first."""
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415 - FSDP2 only where a model is sharded

    state = fully_shard.state(module)
    for each in state._state_ctx.all_states:
        for group in _fsdp_param_groups(each):
            group.post_backward()
    state._root_post_backward_final_callback()


def _fsdp_param_groups(state: Any) -> list[Any]:
    """The param groups (``FSDPParamGroup``) of one ``FSDPState``: ``_fsdp_param_groups`` (a list, as in torch 2.13) or
    ``_fsdp_param_group`` (one or ``None``, as in torch 2.11)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    one = state._fsdp_param_group
    return [] if one is None else [one]


def fsdp_module_groups(module: nn.Module) -> list[Any]:
    """The param groups (``FSDPParamGroup``) of the module ``fully_shard`` was applied to: the unit whose gradients
    one ``post_backward`` reduces (``fully_shard.state(module)._fsdp_param_groups``; none for a module that holds no
    parameter of its own)."""
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415 - FSDP2 only where a model is sharded

    return _fsdp_param_groups(fully_shard.state(module))


def fsdp_group_unsharded_params(group: Any) -> list[nn.Parameter]:
    """The gathered parameters of an ``FSDPParamGroup`` (``torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam
    .unsharded_param`` of each of its ``fsdp_params``): the tensors a forward uses and autograd accumulates gradients
    into while they are gathered."""
    return [fsdp_param.unsharded_param for fsdp_param in group.fsdp_params]


def fsdp_reduce_group(group: Any) -> None:
    """``torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup.post_backward()``: reduce
    (reduce-scatter, or all-reduce over a replicate dimension) the gradients accumulated in the group's gathered
    parameters into its shards' ``.grad``, as FSDP's own post-backward hook does; idempotent (a group whose
    gradients were taken reduces nothing). Gradient sync must be on (``set_requires_gradient_sync(True)``); on CUDA
    it runs on FSDP's reduce-scatter stream, on gloo it blocks."""
    group.post_backward()


def fsdp_set_hooks_idle(module: nn.Module, idle: bool) -> None:
    """``FSDPState._training_state`` of every FSDP state under the root ``module`` (``_state_ctx.all_states``), set
    to the state in which the forward hooks gather nothing, reshard nothing and register no backward hook
    (``idle=True``: ``TrainingState.PRE_BACKWARD`` of ``torch.distributed.fsdp._fully_shard._fsdp_common``, the state
    FSDP2 keeps while activation checkpointing recomputes a forward), or back to ``IDLE`` (``idle=False``). For the
    micro-batches of a step run as two overlapped contexts on two threads, whose hooks would otherwise share and
    flip that state (``parallelize/sharding.py``)."""
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415 - FSDP2 only where a model is sharded
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState  # noqa: PLC0415

    for each in fully_shard.state(module)._state_ctx.all_states:
        each._training_state = TrainingState.PRE_BACKWARD if idle else TrainingState.IDLE


def local_shape_and_offset(tensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape of this rank's chunk of a ``DTensor`` and the chunk's offset in the global tensor
    (``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``: any mesh, any ``Shard`` /
    ``Replicate`` placements, uneven shards as ``torch.chunk`` cuts them)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: PLC0415

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(int(s) for s in shape), tuple(int(o) for o in offset)


def row_owners(tensor: Any) -> list[tuple[int, int, int]]:
    """``(global rank, first row, rows)`` of dim 0 for every rank of a ``DTensor``'s mesh, in mesh order
    (``torch.distributed.tensor._utils._compute_local_shape_and_global_offset`` at each coordinate: any mesh, any
    ``Shard`` / ``_StridedShard`` / ``Replicate`` placements, uneven shards as ``torch.chunk`` cuts them).

    Raises:
        NotImplementedError: a rank holds only part of a row (a placement shards another dimension).
    """
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset  # noqa: PLC0415

    mesh, shape = tensor.device_mesh, tuple(tensor.shape)
    owners = []
    for coordinate in itertools.product(*(range(n) for n in mesh.shape)):
        local_shape, offset = _compute_local_shape_and_global_offset(shape, mesh.shape, list(coordinate),
                                                                     tensor.placements)  # fmt: skip
        if tuple(local_shape[1:]) != shape[1:] or any(offset[1:]):
            raise NotImplementedError(
                f"`row_owners`: the DTensor of shape {shape} with placements {tensor.placements} gives the rank at "
                f"{coordinate} a [{tuple(local_shape)}] block at offset {tuple(offset)}, not whole rows; only tensors "
                "split along dim 0 have rows to move. Keep such a tensor out of expert re-placement."
            )
        owners.append((int(mesh.mesh[coordinate]), int(offset[0]), int(local_shape[0])))
    return owners


def allocate_meta_tensors(module: nn.Module, device: torch.device) -> None:
    """``nn.Module._apply`` (what ``to_empty`` runs) with a function that gives every tensor on meta an uninitialised
    one on ``device`` and leaves the others as they are: under ``fully_shard`` only the shards are allocated, and
    ``FSDPModule._apply`` pads them again (``FSDPParam.reset_sharded_param``)."""
    module._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)


def module_to(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)`` for the tensors that are not on meta (``nn.Module._apply``); the meta ones stay."""
    module._apply(lambda t: t if t.is_meta else t.to(device))


def consolidate_hf_file(parts: str, output: str, keys: Sequence[str]) -> None:
    """``torch.distributed.checkpoint._consolidate_hf_safetensors._consolidate_safetensors_files``: the safetensors
    parts in folder ``parts`` (written by ``HuggingFaceStorageWriter(save_distributed=True)``, each box with its
    offsets) joined into the one file ``output`` holding ``keys`` whole, in that order; one tensor in memory at a
    time, only the folder's files opened."""
    from torch.distributed.checkpoint import _consolidate_hf_safetensors as consolidate  # noqa: PLC0415

    folder, name = os.path.split(output)
    consolidate._consolidate_safetensors_files(parts, folder, dict.fromkeys(keys, name), 1)


class Float32Buffers(nn.Module):
    """A module whose buffers named in ``float32_buffers`` stay float32 through ``.to(dtype)``, ``.half()``,
    ``.bfloat16()``: it extends ``torch.nn.Module._apply``, the method every such conversion goes through."""

    float32_buffers: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def, override]
        module = super()._apply(fn, recurse)
        for name in self.float32_buffers:
            buffer = getattr(self, name, None)
            if buffer is not None and buffer.dtype != torch.float32:
                buffer.data = buffer.data.float()
        return module


# -- torch.distributed.pipelining: the multi-stage schedules' runtime (``_PipelineScheduleRuntime``) ---------------
# An ``OVERLAP_F_B`` handler registered on a schedule does, for each of its two sub-actions, what the runtime's
# private ``_perform_action`` does; these functions are the runtime state it reads and writes.


def pipeline_schedules() -> Any:
    """The ``torch.distributed.pipelining.schedules`` module (its ``_Action`` / ``_ComputationType`` are private)."""
    from torch.distributed.pipelining import schedules

    return schedules


def pipeline_action(stage_index: int, kind: str, microbatch: int | None, sub_actions: tuple | None = None) -> Any:
    """``_Action(stage_index, _ComputationType(kind), microbatch, sub_actions)``; ``kind`` as in ``"F"``."""
    schedules = pipeline_schedules()
    return schedules._Action(stage_index, schedules._ComputationType(kind), microbatch, sub_actions)


def action_kind(action: Any) -> str:
    """The computation type of an ``_Action`` as its string (``"F"``, ``"B"``, ``"OVERLAP_F_B"``, ...)."""
    return str(action.computation_type.value)


def pipeline_runtime(stages: list[Any], num_microbatches: int, loss_fn: Any, *, scale_grads: bool) -> Any:
    """``_PipelineScheduleRuntime(stages, num_microbatches, loss_fn=..., scale_grads=...)``: torch's runtime of an
    action order, before an order is installed (:func:`relower_pipeline_order`)."""
    return pipeline_schedules()._PipelineScheduleRuntime(
        list(stages), num_microbatches, loss_fn=loss_fn, scale_grads=scale_grads
    )


def register_pipeline_action(schedule: Any, kind: str, fn: Callable[[Any, Any], None]) -> None:
    """``_PipelineScheduleRuntime.register_custom_function``: ``fn(action, ctx)`` runs every ``kind`` action."""
    schedule.register_custom_function(pipeline_schedules()._ComputationType(kind), fn)


def relower_pipeline_order(schedule: Any, order: dict[int, list[Any]]) -> None:
    """Install a compute-only ``order`` (rank -> actions) and lower it to the runtime's order with send/recv actions
    (``_prepare_schedule_with_comms``; raises ``AssertionError`` "Malformed compute schedule" when a rank's next
    action can never get its inputs)."""
    schedule.pipeline_order = order
    schedule._prepare_schedule_with_comms(order)


def lowered_pipeline_order(schedule: Any) -> dict[int, list[Any]]:
    """The runtime's order, with send/recv actions (``_PipelineScheduleRuntime.pipeline_order_with_comms``)."""
    return schedule.pipeline_order_with_comms


def set_lowered_pipeline_actions(schedule: Any, rank: int, actions: list[Any]) -> None:
    """Replace rank ``rank``'s runtime order, with send/recv actions
    (``_PipelineScheduleRuntime.pipeline_order_with_comms[rank]``)."""
    schedule.pipeline_order_with_comms[rank] = list(actions)


def pipeline_stages(schedule: Any) -> list[Any]:
    """This rank's ``PipelineStage`` objects of a multi-stage schedule (``_stages``)."""
    return list(schedule._stages)


def pipeline_microbatches(schedule: Any) -> int:
    """The schedule's ``n_microbatches`` (``_n_microbatches``)."""
    return int(schedule._n_microbatches)


def wait_pipeline_recv(schedule: Any, direction: str, stage_index: int, microbatch: int) -> None:
    """Wait for the posted receives of ``(stage_index, microbatch)`` (``fwd_recv_ops`` / ``bwd_recv_ops``, then
    ``_wait_batch_p2p``); ``direction`` is ``"forward"`` or ``"backward"``."""
    ops = schedule.fwd_recv_ops if direction == "forward" else schedule.bwd_recv_ops
    key = (stage_index, microbatch)
    if key not in ops:
        raise RuntimeError(
            f"Pipeline stage {stage_index}, micro-batch {microbatch}: its {direction} input was never received; the "
            "schedule's order is malformed (an OVERLAP_F_B action placed before the receive it needs)."
        )
    pipeline_schedules()._wait_batch_p2p(ops.pop(key))


def compute_pipeline_loss(schedule: Any, stage: Any, output: Any, target_mbs: list | None, microbatch: int) -> None:
    """On the last stage, the schedule's loss of ``output`` against the micro-batch's target, kept for its
    backward (``_maybe_compute_loss``; ``loss_kwargs`` are not passed to custom actions)."""
    schedule._maybe_compute_loss(stage, output, target_mbs, microbatch)


def pipeline_loss(schedule: Any, stage: Any, microbatch: int) -> Any:
    """The kept loss of ``microbatch`` on the last stage, else None (``_maybe_get_loss``)."""
    return schedule._maybe_get_loss(stage, microbatch)


def count_pipeline_backward(schedule: Any, stage_index: int) -> bool:
    """Count one more backward of ``stage_index`` (``_PipelineScheduleRuntime.backward_counter``); True for the
    step's last one."""
    schedule.backward_counter[stage_index] += 1
    return schedule.backward_counter[stage_index] == pipeline_microbatches(schedule)


STAGE_INIT_METHODS = ("_initialize_pp_stages", "_initialize_stages", "_initialize_stage")  # newest torch first


def wrap_pipeline_stage_init(schedule: Any, context: Callable[[], Any]) -> None:
    """Run the schedule's stage initialisation inside ``context()``: at the first step torch infers the stages'
    metadata by running each local stage's forward (and backward) on the first micro-batch (stage 0) or on
    uninitialised tensors of the received shapes (later stages). That is ``_initialize_pp_stages`` (torch >= 2.11),
    else ``_initialize_stages`` (multi-stage) / ``_initialize_stage`` (single-stage)."""
    name = next((n for n in STAGE_INIT_METHODS if callable(getattr(schedule, n, None))), None)
    if name is None:
        raise RuntimeError(
            f"{type(schedule).__name__} (torch {torch.__version__}) has none of {STAGE_INIT_METHODS}, the stage "
            "initialisation whose metadata inference must not count as a training forward. Use a torch version "
            "this package supports (pyproject.toml)."
        )
    initialize = getattr(schedule, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with context():
            return initialize(*args, **kwargs)

    setattr(schedule, name, wrapped)


# -- torch.distributed.tensor.experimental: context parallelism (ring attention over ``DTensor`` SDPA) -------------
# ``context_parallel`` routes SDPA ops on sequence-sharded ``DTensor``s to handlers kept in a module-level dict while
# it is on; ``parallel/context_ring_cpu.py`` adds the CPU op to that dict and reuses torch's ring loops.

CP_ATTENTION_MODULES = (  # newest torch first: later versions moved the code under ``_context_parallel``
    "torch.distributed.tensor.experimental._context_parallel._attention",
    "torch.distributed.tensor.experimental._attention",
)
CP_ATTENTION_NAMES = (
    "_templated_ring_attention",
    "_templated_ring_attention_backward",
    "custom_ops",
    "_cp_options",
    "_ContextParallel",
    "_enable_context_parallel_dispatcher",
    "_disable_context_parallel_dispatcher",
)


def cp_attention_module() -> Any:
    """``torch.distributed.tensor.experimental._context_parallel._attention`` (``experimental._attention`` in older
    torch): the module of torch's context-parallel SDPA (ring loops, the dispatcher's handler table, its options),
    checked to hold every name this package reads (``CP_ATTENTION_NAMES``)."""
    import importlib  # noqa: PLC0415

    for name in CP_ATTENTION_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        missing = [n for n in CP_ATTENTION_NAMES if not hasattr(module, n)]
        if not missing:
            return module
    raise RuntimeError(
        f"torch {torch.__version__} has no context-parallel attention module holding {CP_ATTENTION_NAMES} (looked in "
        f"{CP_ATTENTION_MODULES}). Use a torch version this package supports (pyproject.toml) or run with cp=1."
    )


def ring_attention_forward(group: Any, op: Any, query: Tensor, key: Tensor, value: Tensor, **kwargs: Any) -> tuple:
    """``_templated_ring_attention(group, 2, op, query, key, value, **kwargs)``: torch's ring over the cp ``group``
    for local ``(batch, heads, seq, dim)`` shards: k/v travel round the ring, ``op`` (an SDPA op returning
    ``(out, logsumexp, ...)``) runs on each block (causal, full or skipped, by torch's load-balance rule), the
    partial outputs are merged by their log-sum-exp. Returns ``(out, logsumexp, *rest of op's outputs)``."""
    return cp_attention_module()._templated_ring_attention(group, 2, op, query, key, value, **kwargs)


def ring_attention_backward(group: Any, op: Any, grad_out: Tensor, **kwargs: Any) -> tuple:
    """``_templated_ring_attention_backward(group, 2, op, grad_out, "grad_out", **kwargs)``: the ring of the
    backward; ``op`` (an SDPA backward op taking ``grad_out``, ``query``, ``key``, ``value``, ``out``,
    ``logsumexp``, ``is_causal`` by name) runs on each block and the k/v gradients travel back to their owners.
    Returns ``(grad_query, grad_key, grad_value, *rest)``."""
    return cp_attention_module()._templated_ring_attention_backward(group, 2, op, grad_out, "grad_out", **kwargs)


def cpu_sdpa_ops() -> tuple[Any, Any]:
    """``aten._scaled_dot_product_flash_attention_for_cpu.default`` and its ``_backward``: the ops SDPA runs on CPU
    (``(q, k, v, dropout_p, is_causal, *, attn_mask, scale) -> (out, logsumexp)`` and ``(grad_out, q, k, v, out,
    logsumexp, dropout_p, is_causal, *, attn_mask, scale) -> (grad_q, grad_k, grad_v)``)."""
    aten = torch.ops.aten
    return (
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    )


def cp_handler_table() -> dict:
    """``custom_ops`` of torch's context-parallel module: op -> handler, merged into ``DTensor``'s op dispatcher
    (``DTensor._op_dispatcher._custom_op_handlers``) each time the context-parallel dispatcher is enabled and
    dropped when it is disabled. Mutated in place to add an op."""
    return cp_attention_module().custom_ops


def cp_load_balance() -> bool:
    """``_cp_options.enable_load_balance``: whether torch's ring treats the local shards as head-tail pairs (read at
    every forward and backward; torch requires ``is_causal=True`` while it is on)."""
    return bool(cp_attention_module()._cp_options.enable_load_balance)


def set_cp_load_balance(enabled: bool) -> None:
    """Set ``_cp_options.enable_load_balance`` (process-wide)."""
    cp_attention_module()._cp_options.enable_load_balance = bool(enabled)


def enable_cp_dispatcher(enabled: bool) -> None:
    """``_enable_context_parallel_dispatcher()`` / ``_disable_context_parallel_dispatcher()``: install (remove) the
    ring handlers and the sequence-sharding rules of torch's SDPA ops in ``DTensor``'s dispatcher (process-wide,
    not re-entrant: one disable removes them)."""
    module = cp_attention_module()
    if enabled:
        module._enable_context_parallel_dispatcher()
    else:
        module._disable_context_parallel_dispatcher()


def cp_dispatcher_enabled() -> bool:
    """Whether torch's context-parallel handlers are in ``DTensor._op_dispatcher._custom_op_handlers`` now (its
    flash-attention op is)."""
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    return torch.ops.aten._scaled_dot_product_flash_attention.default in DTensor._op_dispatcher._custom_op_handlers


def loss_parallel_enabled() -> bool:
    """Whether torch's ``loss_parallel`` handlers are in ``DTensor._op_dispatcher._custom_op_handlers`` now (its
    ``nll_loss_forward`` is): the context is entered, by this thread or another (the table is process-wide)."""
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    return torch.ops.aten.nll_loss_forward.default in DTensor._op_dispatcher._custom_op_handlers


def cp_sdpa_wrappers(seq_dim: int = 2) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``_ContextParallel(seq_dim, SDPA).sdpa_input_fn`` / ``sdpa_output_fn``: what torch runs around SDPA under
    context parallelism, ``(module, args, kwargs, mesh) -> (args, kwargs)`` wrapping each tensor as a ``DTensor``
    sharded on ``seq_dim`` of ``mesh``, and ``(module, inputs, outputs, mesh) -> outputs`` taking the local shards
    back out."""
    module = cp_attention_module()
    style = module._ContextParallel(seq_dim=seq_dim, attention_type=module._ContextParallel.AttentionType.SDPA)
    return style.sdpa_input_fn, style.sdpa_output_fn


def dtensor_op_info(op: Any, args: tuple, kwargs: dict) -> Any:
    """``DTensor._op_dispatcher.unwrap_to_op_info``: the op's local arguments (``local_args`` / ``local_kwargs``),
    its ``DTensor`` specs (``flat_args_schema``) and ``compute_mesh``, as a custom op handler receives them."""
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    return DTensor._op_dispatcher.unwrap_to_op_info(op, args, kwargs)


def make_wrapper_subclass(cls: type, shape: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``torch.Tensor._make_wrapper_subclass``: a tensor of class ``cls`` with this shape, dtype and device and no
    storage of its own (its ``__torch_dispatch__`` says what its operations compute)."""
    return Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)


def disabled_torch_function() -> Any:
    """``torch._C._disabled_torch_function_impl``: the ``__torch_function__`` of a wrapper subclass whose operations
    all go through ``__torch_dispatch__`` (results are not re-wrapped in the subclass)."""
    return torch._C._disabled_torch_function_impl


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``torch.utils._pytree.tree_map``: ``fn`` applied to every leaf of nested tuples, lists and dicts."""
    from torch.utils import _pytree  # noqa: PLC0415

    return _pytree.tree_map(fn, tree)
