"""Every private torch name of ``_compat/torch.py`` still exists and behaves as the package relies on.

One test per name; a failure names the torch version, the private name and the compat function to update.
"""

from __future__ import annotations

import re

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_moe_overlap._compat import torch as torch_compat
from tests.helpers.tolerance import reordered_sum_tol


def _broken(name: str, function: str, what: str = "is gone") -> str:
    return (
        f"torch {torch.__version__}: `{name}` {what}; update `lightning_moe_overlap/_compat/torch.py::{function}` "
        "(and the supported torch range in pyproject.toml)"
    )


def _require(owner: Any, attribute: str, name: str, function: str) -> None:
    assert hasattr(owner, attribute), _broken(name, function)


def test_foreach_norm() -> None:
    _require(torch, "_foreach_norm", "torch._foreach_norm", "foreach_norm")
    tensors = [torch.arange(4.0), torch.full((2, 3), -2.0)]
    norms = torch_compat.foreach_norm(tensors, 2.0, dtype=torch.float64)
    assert [n.dtype for n in norms] == [torch.float64] * 2, _broken("torch._foreach_norm", "foreach_norm", "ignores dtype")
    expected = torch.stack([t.double().norm() for t in tensors])
    assert torch.equal(torch.stack(norms), expected), _broken("torch._foreach_norm", "foreach_norm", "changed values")


def test_foreach_mul_() -> None:
    _require(torch, "_foreach_mul_", "torch._foreach_mul_", "foreach_mul_")
    tensors = [torch.arange(4.0), torch.full((2, 3), -2.0)]
    torch_compat.foreach_mul_(tensors, torch.tensor(0.5))
    halved = torch.equal(tensors[0], torch.arange(4.0) / 2) and torch.equal(tensors[1], torch.full((2, 3), -1.0))
    assert halved, _broken("torch._foreach_mul_", "foreach_mul_", "no longer scales in place")


def test_assert_async() -> None:
    _require(torch, "_assert_async", "torch._assert_async", "assert_async")
    torch_compat.assert_async(torch.tensor(True), "never shown")
    with pytest.raises(RuntimeError, match="the rule and the fix"):
        torch_compat.assert_async(torch.tensor([1, 2]).eq(1).all(), "the rule and the fix")


def test_cuda_sleep() -> None:
    _require(torch.cuda, "_sleep", "torch.cuda._sleep", "cuda_sleep")
    if torch.cuda.is_available():  # the kernel itself needs a GPU; on CPU the name's presence is what can be checked
        torch_compat.cuda_sleep(1000)
        torch.cuda.synchronize()


def test_grouped_mm() -> None:
    _require(torch, "_grouped_mm", "torch._grouped_mm", "grouped_mm / grouped_mm_available")
    assert torch_compat.grouped_mm_available()
    if torch.__version__ < "2.9":  # no CPU kernel before 2.9 (moe/grouped.py::grouped_mm_supported)
        return
    x_RI, w_eIO = torch.randn(7, 4), torch.randn(3, 4, 8)
    sizes = [2, 0, 5]  # an expert with no rows
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    y_RO = torch_compat.grouped_mm(x_RI, w_eIO, offs=offs)
    looped = torch.cat([x_e @ w_e for x_e, w_e in zip(x_RI.split(sizes), w_eIO)])
    # the same dot products of I = 4 terms, maybe summed in another order: within reordered_sum_tol(4) of the sum
    # of their terms' absolute values, entry by entry (tests/helpers/tolerance.py)
    bound = reordered_sum_tol(4, torch.cat([x_e.abs() @ w_e.abs() for x_e, w_e in zip(x_RI.split(sizes), w_eIO)]))
    same = bool(((y_RO - looped).abs() <= bound).all())
    assert same, _broken("torch._grouped_mm", "grouped_mm", "changed its result")
    private = torch._grouped_mm(x_RI, w_eIO, offs=offs)
    assert torch.equal(y_RO, private), _broken("torch._grouped_mm", "grouped_mm", "differs from its public wrapper")


def test_scaled_mm() -> None:
    _require(torch, "_scaled_mm", "torch._scaled_mm", "scaled_mm")
    a, b = torch.randn(8, 32), torch.randn(16, 32)
    qa, qb = a.to(torch.float8_e4m3fn), b.to(torch.float8_e5m2)  # e4m3 x e5m2, b column-major
    exact = qa.float() @ qb.float().t()
    one = torch.tensor(1.0)
    out = torch_compat.scaled_mm(qa, qb.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    # the same float32 dot products of 32 exact products, maybe summed in another order (tests/helpers/tolerance.py)
    bound = reordered_sum_tol(32, qa.float().abs() @ qb.float().abs().t())
    assert bool(((out - exact).abs() <= bound).all()), _broken("torch._scaled_mm", "scaled_mm", "changed values")
    rows, cols = torch.full((8, 1), 2.0), torch.full((1, 16), 0.25)  # rowwise scales
    out = torch_compat.scaled_mm(qa, qb.t(), scale_a=rows, scale_b=cols, out_dtype=torch.bfloat16)
    ok = out.dtype == torch.bfloat16 and torch.allclose(out.float(), exact * 0.5, rtol=1e-2, atol=1e-2)
    assert ok, _broken("torch._scaled_mm", "scaled_mm", "changed its rowwise scales or output dtype")


def test_current_graph_task_id() -> None:
    _require(torch._C, "_current_graph_task_id", "torch._C._current_graph_task_id", "current_graph_task_id")
    inside: list[int] = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda grad: inside.append(torch_compat.current_graph_task_id()))
    y.sum().backward()
    outside = torch_compat.current_graph_task_id()
    ok = outside == -1 and len(inside) == 1 and inside[0] != -1
    assert ok, _broken("torch._C._current_graph_task_id", "current_graph_task_id", f"reads {outside} / {inside}")


def test_top_saved_tensors_hooks() -> None:
    name, function = "torch._C._autograd._top_saved_tensors_default_hooks", "top_saved_tensors_hooks"
    _require(torch._C._autograd, "_top_saved_tensors_default_hooks", name, function)
    assert torch_compat.top_saved_tensors_hooks() is None, _broken(name, function, "reports hooks where none is")

    def pack(t: torch.Tensor) -> torch.Tensor:
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, pack):
        hooks = torch_compat.top_saved_tensors_hooks()
    assert hooks is not None and hooks[0] is pack, _broken(name, function, "no longer returns the (pack, unpack) hooks")

    seen: list[str] = []  # callbacks/_forward_regions.py::inside_checkpoint tells checkpoint's hooks by their module

    def body(x: torch.Tensor) -> torch.Tensor:
        top = torch_compat.top_saved_tensors_hooks()
        seen.append(getattr(top[0], "__module__", "") if top else "")
        return x.sin()

    checkpoint(body, torch.ones(2, requires_grad=True), use_reentrant=False).sum().backward()
    in_checkpoint = seen[:1] == ["torch.utils.checkpoint"]
    assert in_checkpoint, _broken(name, function, f"shows checkpoint's hooks from modules {seen}")


def test_default_store(tmp_path) -> None:
    from torch.distributed import distributed_c10d

    _require(distributed_c10d, "_get_default_store", "torch.distributed.distributed_c10d._get_default_store", "default_store")
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        store = torch_compat.default_store()
        store.set("compat-check", "1")
        assert isinstance(store, dist.Store) and store.get("compat-check") == b"1", _broken(
            "torch.distributed.distributed_c10d._get_default_store", "default_store", "returns no working store"
        )
    finally:
        if owned:
            dist.destroy_process_group()


def test_flatten_mesh(tmp_path) -> None:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    name, function = "torch.distributed.device_mesh.DeviceMesh._flatten", "flatten_mesh"
    _require(DeviceMesh, "_flatten", name, function)
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("a", "b", "c"))
        flat = torch_compat.flatten_mesh(mesh["b", "c"], "bc")
        assert flat.mesh_dim_names == ("bc",) and flat.ndim == 1, _broken(name, function, f"returned {flat}")
        assert dist.get_process_group_ranks(flat.get_group()) == [0], _broken(name, function, "has no group")
    finally:
        if owned:
            dist.destroy_process_group()


def test_module_apply_keeps_float32_buffers() -> None:
    name, function = "torch.nn.Module._apply", "Float32Buffers"
    assert "_apply" in vars(nn.Module), _broken(name, function)

    class Scaled(torch_compat.Float32Buffers):
        float32_buffers = ("kept",)

        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(2))
            self.register_buffer("kept", torch.zeros(2))
            self.register_buffer("cast", torch.zeros(2))

    for convert in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.double()):
        module = convert(Scaled())
        dtypes = (module.weight.dtype, module.kept.dtype, module.cast.dtype)
        assert module.kept.dtype == torch.float32 and module.weight.dtype == module.cast.dtype != torch.float32, (
            _broken(name, function, f"is no longer what dtype conversions run through (dtypes {dtypes})")
        )


def _compat_names() -> list[str]:
    return sorted(
        name
        for name, value in vars(torch_compat).items()
        if not name.startswith("_") and callable(value) and getattr(value, "__module__", "") == torch_compat.__name__
    )


@pytest.mark.parametrize("name", _compat_names())
def test_every_compat_name_names_its_private_torch_name_and_has_a_test(name: str) -> None:
    doc = getattr(torch_compat, name).__doc__ or ""
    names_it = "``torch." in doc or re.search(r"``_\w|\._\w", doc) is not None  # torch.x._y, or _Private of a module
    assert names_it, f"`_compat/torch.py::{name}` does not say which private torch name it reaches"
    assert f"torch_compat.{name}" in Path(__file__).read_text(), f"`_compat/torch.py::{name}` has no test here"


# -- torch.distributed.pipelining: the private runtime names used by pipeline/ --------------------------------------
def test_private_pipelining_names_exist() -> None:
    from torch.distributed.pipelining import schedules

    version = f"torch {torch.__version__}"
    for name in ("_Action", "_ComputationType", "_PipelineScheduleRuntime", "_PipelineContext", "_wait_batch_p2p"):
        assert hasattr(schedules, name), f"{version}: `pipelining.schedules.{name}` is gone; update `_compat/torch.py`"
    runtime = schedules._PipelineScheduleRuntime
    for name in ("register_custom_function", "_prepare_schedule_with_comms", "_maybe_compute_loss", "_maybe_get_loss"):
        assert hasattr(runtime, name), f"{version}: `_PipelineScheduleRuntime.{name}` is gone; update `_compat`"
    fields = set(schedules._PipelineContext.__dataclass_fields__)
    assert {"schedule_ref", "arg_mbs", "kwarg_mbs", "target_mbs"} <= fields, f"{version}: _PipelineContext {fields}"


def test_pipeline_actions_build_and_print_as_torch_parses_them() -> None:
    forward = torch_compat.pipeline_action(0, "F", 7)
    backward = torch_compat.pipeline_action(2, "B", 3)
    pair = torch_compat.pipeline_action(-1, "OVERLAP_F_B", None, (forward, backward))
    assert str(forward) == "0F7" and torch_compat.action_kind(backward) == "B"
    assert torch_compat.action_kind(pair) == "OVERLAP_F_B"
    parsed = torch_compat.pipeline_schedules()._Action.from_str(str(pair))
    assert parsed == pair, f"torch {torch.__version__}: OVERLAP_F_B round trip gave {parsed}"


def test_the_runtime_state_an_overlap_handler_uses() -> None:
    from types import SimpleNamespace

    from torch.distributed.pipelining import ScheduleInterleaved1F1B

    stages = [SimpleNamespace(num_stages=4, group_size=2, group_rank=0, stage_index=s) for s in (0, 2)]
    schedule = ScheduleInterleaved1F1B(stages, 4, loss_fn=lambda out, target: out)
    calls: list[str] = []
    torch_compat.register_pipeline_action(schedule, "OVERLAP_F_B", lambda action, ctx: calls.append(str(action)))
    assert len(torch_compat.lowered_pipeline_order(schedule)[0]) > len([a for a in schedule.pipeline_order[0] if a])
    assert [s.stage_index for s in torch_compat.pipeline_stages(schedule)] == [0, 2]
    assert torch_compat.pipeline_microbatches(schedule) == 4
    assert [torch_compat.count_pipeline_backward(schedule, 2) for _ in range(4)] == [False, False, False, True]
    with pytest.raises(RuntimeError, match=r"stage 2, micro-batch 1: its backward input was never received"):
        torch_compat.wait_pipeline_recv(schedule, "backward", 2, 1)


def test_the_runtime_order_and_losses_an_overlap_handler_uses() -> None:
    from types import SimpleNamespace

    from torch.distributed.pipelining import ScheduleInterleaved1F1B

    stages = [SimpleNamespace(num_stages=4, group_size=2, group_rank=1, stage_index=s, is_last=s == 3) for s in (1, 3)]
    schedule = ScheduleInterleaved1F1B(stages, 4, loss_fn=lambda out, target: (out - target).sum())
    before = [str(a) for a in torch_compat.lowered_pipeline_order(schedule)[1]]
    torch_compat.relower_pipeline_order(schedule, schedule.pipeline_order)
    assert [str(a) for a in torch_compat.lowered_pipeline_order(schedule)[1]] == before
    kept = [a for a in torch_compat.lowered_pipeline_order(schedule)[1] if torch_compat.action_kind(a) != "SEND_F"]
    torch_compat.set_lowered_pipeline_actions(schedule, 1, kept)
    assert [str(a) for a in torch_compat.lowered_pipeline_order(schedule)[1]] == [str(a) for a in kept] != before
    targets = [torch.full((2,), float(i)) for i in range(4)]
    torch_compat.compute_pipeline_loss(schedule, stages[1], torch.ones(2), targets, 0)
    torch_compat.compute_pipeline_loss(schedule, stages[0], torch.ones(2), targets, 1)  # not the last stage: no loss
    assert torch.equal(torch_compat.pipeline_loss(schedule, stages[1], 0), torch.tensor(2.0))
    assert torch_compat.pipeline_loss(schedule, stages[0], 0) is None


def test_the_stage_initialisation_runs_inside_the_given_context() -> None:
    from contextlib import contextmanager
    from types import SimpleNamespace

    from torch.distributed.pipelining import ScheduleInterleaved1F1B

    stages = [SimpleNamespace(num_stages=4, group_size=2, group_rank=0, stage_index=s) for s in (0, 2)]
    schedule = ScheduleInterleaved1F1B(stages, 4, loss_fn=lambda out, target: out)
    name = torch_compat.STAGE_INIT_METHODS[0]
    assert callable(getattr(schedule, name, None)), f"torch {torch.__version__}: `{name}` is gone; update `_compat`"
    depth, seen = [0], []

    @contextmanager
    def context():
        depth[0] += 1
        yield
        depth[0] -= 1

    setattr(schedule, name, lambda *args, **kwargs: seen.append((depth[0], args)))  # torch's own needs real stages
    torch_compat.wrap_pipeline_stage_init(schedule, context)
    getattr(schedule, name)("args")
    assert seen == [(1, ("args",))] and depth == [0]
    with pytest.raises(RuntimeError, match=r"has none of .*_initialize_pp_stages.*Use a torch version"):
        torch_compat.wrap_pipeline_stage_init(SimpleNamespace(), context)



def test_fsdp_lazy_init_and_reduce_gradients(tmp_path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    state_name = "torch.distributed.fsdp.fully_shard.state(...)"
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 2))
        reference = nn.Sequential(nn.Linear(3, 2))
        reference.load_state_dict(model.state_dict())
        fully_shard(model, mesh=init_device_mesh("cpu", (1, 1), mesh_dim_names=("rep", "shard")))
        state = fully_shard.state(model)
        for attribute in ("_lazy_init", "_state_ctx", "_root_post_backward_final_callback"):
            _require(state, attribute, f"{state_name}.{attribute}", "fsdp_lazy_init / fsdp_reduce_gradients")
        torch_compat.fsdp_lazy_init(model)
        assert state._is_root, _broken(f"{state_name}._lazy_init", "fsdp_lazy_init", "did not make it the root")
        model.set_requires_gradient_sync(False)
        model.set_reshard_after_backward(False)
        model.unshard()
        inputs = [torch.randn(4, 3), torch.randn(4, 3)]
        for x in inputs:  # two micro-batches, gradients accumulated unreduced
            model(x).square().sum().backward()
            reference(x).square().sum().backward()
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)
        torch_compat.fsdp_reduce_gradients(model)
        grad = model[0].weight.grad
        what = "left no reduced gradient on the sharded parameter"
        assert grad is not None, _broken(f"{state_name}._fsdp_param_groups.post_backward", "fsdp_reduce_gradients", what)
        assert torch.allclose(grad.to_local(), reference[0].weight.grad), _broken(
            "FSDPParamGroup.post_backward", "fsdp_reduce_gradients", "reduced other values"
        )
    finally:
        if owned:
            dist.destroy_process_group()


def _one_rank_fsdp(tmp_path):
    """A 1-rank gloo world (if none is running) and a ``fully_shard``-ed two-layer model on it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    fully_shard(model[0], mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return model, owned


def test_fsdp_set_hooks_idle(tmp_path) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_common
    from torch.distributed.tensor import DTensor

    _require(_fsdp_common, "TrainingState", "torch.distributed.fsdp._fully_shard._fsdp_common.TrainingState",
             "fsdp_set_hooks_idle")  # fmt: skip
    model, owned = _one_rank_fsdp(tmp_path)
    try:
        torch_compat.fsdp_lazy_init(model)
        states = fully_shard.state(model)._state_ctx.all_states
        assert len(states) == 2, _broken("FSDPState._state_ctx.all_states", "fsdp_set_hooks_idle", "misses states")
        for module in (model[0], model):
            module.set_requires_gradient_sync(False, recurse=False)
            module.unshard()
        torch_compat.fsdp_set_hooks_idle(model, True)
        assert {s._training_state for s in states} == {_fsdp_common.TrainingState.PRE_BACKWARD}
        model(torch.ones(2, 4)).sum().backward()  # the hooks act on nothing: the gathered parameters stay, with grads
        assert all(p.grad is not None and not isinstance(p, DTensor) for p in model.parameters()), _broken(
            "FSDPState._training_state (PRE_BACKWARD)", "fsdp_set_hooks_idle", "no longer keeps the hooks idle"
        )
        assert {s._training_state for s in states} == {_fsdp_common.TrainingState.PRE_BACKWARD}
        torch_compat.fsdp_set_hooks_idle(model, False)
        assert {s._training_state for s in states} == {_fsdp_common.TrainingState.IDLE}
    finally:
        if owned:
            dist.destroy_process_group()


def test_fsdp_unit_groups_unsharded_params_and_reduce_group(tmp_path) -> None:
    """A unit's groups, the gathered parameters autograd accumulates into, and one group's ``post_backward``."""
    model, owned = _one_rank_fsdp(tmp_path)
    try:
        torch_compat.fsdp_lazy_init(model)
        model.set_requires_gradient_sync(False)
        model.unshard()
        model[0].unshard()
        groups = torch_compat.fsdp_module_groups(model[0])
        assert len(groups) == 1, _broken("FSDPState._fsdp_param_groups", "fsdp_module_groups", "no group of the unit")
        gathered = torch_compat.fsdp_group_unsharded_params(groups[0])
        assert [p is q for p, q in zip(gathered, model[0].parameters())] == [True, True], _broken(
            "FSDPParam.unsharded_param", "fsdp_group_unsharded_params", "is not what the gathered module holds"
        )
        model(torch.ones(2, 4)).sum().backward()
        expected = [p.grad.clone() for p in gathered]
        model.set_requires_gradient_sync(True)
        torch_compat.fsdp_reduce_group(groups[0])
        assert all(p.grad is None for p in gathered)  # taken by the reduction
        model[0].reshard()
        sharded = [p.grad for p in model[0].parameters()]  # the shards again once resharded
        assert all(g is not None for g in sharded), _broken(
            "FSDPParamGroup.post_backward", "fsdp_reduce_group", "left no gradient on the shards"
        )
        assert all(torch.equal(g.to_local(), e) for g, e in zip(sharded, expected))
    finally:
        if owned:
            dist.destroy_process_group()


def test_grad_scaler_found_inf_reads_the_flags_unscale_recorded() -> None:
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    assert torch_compat.grad_scaler_found_inf(scaler, optimizer) == []  # nothing unscaled yet
    scaler.scale(param.sum()).backward()
    param.grad[1] = float("inf")
    scaler.unscale_(optimizer)
    flags = torch_compat.grad_scaler_found_inf(scaler, optimizer)
    assert [float(f) for f in flags] == [1.0], f"torch {torch.__version__}: GradScaler's per-optimizer state moved"


def test_fsdp_param_groups_reads_both_spellings() -> None:
    """torch 2.13 keeps a list ``_fsdp_param_groups``; torch 2.11 one ``_fsdp_param_group`` (or None)."""
    from types import SimpleNamespace

    groups = [object(), object()]
    assert torch_compat._fsdp_param_groups(SimpleNamespace(_fsdp_param_groups=groups)) == groups
    one = object()
    assert torch_compat._fsdp_param_groups(SimpleNamespace(_fsdp_param_group=one)) == [one]
    assert torch_compat._fsdp_param_groups(SimpleNamespace(_fsdp_param_group=None)) == []


def test_gloo_options_carry_a_timeout_into_a_mesh(world_of_one) -> None:
    from datetime import timedelta

    from torch.distributed.device_mesh import init_device_mesh

    options = torch_compat.set_options_timeout(torch_compat.gloo_options(), timedelta(seconds=11))
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("x",), backend_override={"x": ("gloo", options)})
    backend = mesh.get_group()._get_backend(torch.device("cpu"))
    assert backend.options._timeout == timedelta(seconds=11), _broken(
        "ProcessGroupGloo._Options", "gloo_options", "no longer carries the timeout into the mesh's group"
    )


def test_local_shape_and_offset(world_of_one) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    tensor = distribute_tensor(torch.zeros(5, 3), init_device_mesh("cpu", (1,)), [Shard(0)])
    assert torch_compat.local_shape_and_offset(tensor) == ((5, 3), (0, 0)), (
        f"torch {torch.__version__}: `compute_local_shape_and_global_offset` changed; update `_compat/torch.py`"
    )


def test_row_owners_of_experts_sharded_over_edp_then_ep() -> None:
    """The layout ``fully_shard`` over edp gives experts already ``Shard(0)`` over ep (``_StridedShard`` then
    ``Shard``): rank (edp d, ep r) holds rows ``4r + 2d`` and ``4r + 2d + 1`` of 8; ``Replicate`` holds all."""
    from types import SimpleNamespace

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = SimpleNamespace(shape=(2, 2), mesh=torch.tensor([[0, 1], [2, 3]]))
    fsdp = SimpleNamespace(device_mesh=mesh, shape=torch.Size([8, 3]),
                           placements=(_StridedShard(0, split_factor=2), Shard(0)))  # fmt: skip
    assert torch_compat.row_owners(fsdp) == [(0, 0, 2), (1, 4, 2), (2, 2, 2), (3, 6, 2)], _broken(
        "_compute_local_shape_and_global_offset", "row_owners", "no longer gives strided shards' rows"
    )
    replicated = SimpleNamespace(device_mesh=mesh, shape=torch.Size([8, 3]), placements=(Replicate(), Shard(0)))
    assert torch_compat.row_owners(replicated) == [(0, 0, 4), (1, 4, 4), (2, 0, 4), (3, 4, 4)]
    columns = SimpleNamespace(device_mesh=mesh, shape=torch.Size([8, 4]), placements=(Shard(1), Shard(0)))
    with pytest.raises(NotImplementedError, match=r"not whole rows; only tensors split along dim 0 have rows"):
        torch_compat.row_owners(columns)


def test_allocate_meta_tensors_and_module_to_leave_the_others() -> None:
    module = nn.Linear(3, 2)
    bias = module.bias
    module.weight = nn.Parameter(torch.empty(2, 3, device="meta"))
    torch_compat.module_to(module, torch.device("cpu"))
    assert module.weight.is_meta and module.bias is bias, _broken("nn.Module._apply", "module_to", "moved a meta tensor")
    torch_compat.allocate_meta_tensors(module, torch.device("cpu"))
    assert not module.weight.is_meta and tuple(module.weight.shape) == (2, 3), _broken(
        "nn.Module._apply", "allocate_meta_tensors", "no longer allocates the meta tensors"
    )
    assert torch.equal(module.bias, bias), _broken("nn.Module._apply", "allocate_meta_tensors", "changed a held one")


def test_consolidate_hf_file(tmp_path) -> None:
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageWriter, save

    tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4)}
    writer = HuggingFaceStorageWriter(str(tmp_path / "parts"), fqn_to_index_mapping={"a": 1, "b": 2},
                                      save_distributed=True)  # fmt: skip
    save(tensors, storage_writer=writer, no_dist=True)
    torch_compat.consolidate_hf_file(str(tmp_path / "parts"), str(tmp_path / "out.safetensors"), ["b", "a"])
    found = load_file(tmp_path / "out.safetensors")
    assert found.keys() == tensors.keys() and all(torch.equal(found[k], tensors[k]) for k in tensors), _broken(
        "_consolidate_hf_safetensors._consolidate_safetensors_files", "consolidate_hf_file",
        "no longer joins the HF writer's parts into one file",
    )


# -- torch.distributed.tensor.experimental: context parallelism (parallel/context_*.py) -----------------------------
def _cp_name(name: str) -> str:
    return f"{torch_compat.cp_attention_module().__name__}.{name}"


def _cp_qkv() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, 8, 4, generator=g) for _ in range(3)]


def test_cp_attention_module() -> None:
    module = torch_compat.cp_attention_module()
    missing = [n for n in torch_compat.CP_ATTENTION_NAMES if not hasattr(module, n)]
    assert not missing, _broken(f"{module.__name__}: {missing}", "cp_attention_module")


def test_cpu_sdpa_ops() -> None:
    forward, backward = torch_compat.cpu_sdpa_ops()
    q, k, v = _cp_qkv()
    out, lse = forward(q, k, v, 0.0, True, scale=None)
    grads = backward(torch.ones_like(out), q, k, v, out, lse, 0.0, True, scale=None)
    ok = lse.shape == (1, 2, 8) and [g.shape for g in grads] == [q.shape] * 3
    assert ok, _broken("aten._scaled_dot_product_flash_attention_for_cpu(_backward)", "cpu_sdpa_ops", "changed")


def test_ring_attention_forward_and_backward(world_of_one) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    group = init_device_mesh("cpu", (1,)).get_group()
    forward, backward = torch_compat.cpu_sdpa_ops()
    q, k, v = _cp_qkv()
    before = torch_compat.cp_load_balance()
    torch_compat.set_cp_load_balance(False)
    try:
        out, lse = torch_compat.ring_attention_forward(group, forward, q, k, v, is_causal=True)[:2]
        want_out, want_lse = forward(q, k, v, is_causal=True)
        same = torch.allclose(out, want_out, atol=1e-6) and torch.allclose(lse, want_lse, atol=1e-6)
        assert same, _broken(_cp_name("_templated_ring_attention"), "ring_attention_forward", "changed its result")
        grad_out = torch.ones_like(out)
        grads = torch_compat.ring_attention_backward(
            group, backward, grad_out, query=q, key=k, value=v, out=want_out, logsumexp=want_lse, is_causal=True,
            dropout_p=0.0,
        )[:3]  # fmt: skip
        want = backward(grad_out, q, k, v, want_out, want_lse, 0.0, True)
        same = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, want, strict=True))
        assert same, _broken(_cp_name("_templated_ring_attention_backward"), "ring_attention_backward", "changed")
    finally:
        torch_compat.set_cp_load_balance(before)


def test_cp_handler_table_and_dispatcher() -> None:
    from torch.distributed.tensor import DTensor

    table = torch_compat.cp_handler_table()
    flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    assert flash in table, _broken(_cp_name("custom_ops"), "cp_handler_table", "no longer maps the flash op")
    assert not torch_compat.cp_dispatcher_enabled()
    torch_compat.enable_cp_dispatcher(True)
    try:
        merged = all(DTensor._op_dispatcher._custom_op_handlers.get(op) is h for op, h in table.items())
        assert merged and torch_compat.cp_dispatcher_enabled(), _broken(
            _cp_name("_enable_context_parallel_dispatcher"), "enable_cp_dispatcher / cp_dispatcher_enabled",
            "no longer merges custom_ops into DTensor._op_dispatcher._custom_op_handlers",
        )  # fmt: skip
    finally:
        torch_compat.enable_cp_dispatcher(False)
    assert not torch_compat.cp_dispatcher_enabled(), _broken(
        _cp_name("_disable_context_parallel_dispatcher"), "enable_cp_dispatcher", "no longer removes custom_ops"
    )


def test_cp_load_balance() -> None:
    before = torch_compat.cp_load_balance()
    torch_compat.set_cp_load_balance(not before)
    try:
        options = torch_compat.cp_attention_module()._cp_options
        assert options.enable_load_balance is (not before), _broken(_cp_name("_cp_options"), "set_cp_load_balance")
    finally:
        torch_compat.set_cp_load_balance(before)


def test_cp_sdpa_wrappers(world_of_one) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (1,))
    wrap, unwrap = torch_compat.cp_sdpa_wrappers()
    q, k, v = _cp_qkv()
    args, kwargs = wrap(None, (q, k), {"value": v, "is_causal": True}, mesh)
    wrapped = [*args, kwargs["value"]]
    ok = all(isinstance(t, DTensor) and t.placements == (Shard(2),) for t in wrapped) and kwargs["is_causal"] is True
    assert ok, _broken(_cp_name("_ContextParallel.sdpa_input_fn"), "cp_sdpa_wrappers", "wraps differently")
    back = unwrap(None, (args, kwargs), args[0], mesh)
    assert not isinstance(back, DTensor) and torch.equal(back, q), _broken(
        _cp_name("_ContextParallel.sdpa_output_fn"), "cp_sdpa_wrappers", "no longer returns the local shard"
    )


def test_dtensor_op_info(world_of_one) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (1,))
    q, k, v = _cp_qkv()
    sharded = [DTensor.from_local(t, mesh, (Shard(2),), run_check=False) for t in (q, k, v)]
    info = torch_compat.dtensor_op_info(torch_compat.cpu_sdpa_ops()[0], tuple(sharded), {"scale": 0.5})
    ok = (
        info.compute_mesh is mesh
        and all(torch.equal(a, b) for a, b in zip(info.local_args, (q, k, v), strict=True))
        and [tuple(s.placements) for s in info.flat_args_schema] == [(Shard(2),)] * 3
        and info.local_kwargs == {"scale": 0.5}
    )
    assert ok, _broken("DTensor._op_dispatcher.unwrap_to_op_info", "dtensor_op_info", "returns another OpInfo")


@pytest.mark.parametrize(("seq", "cp"), [(8, 2), (24, 3), (16, 4)])
def test_cp_batch_order_is_torchs_head_tail(seq: int, cp: int) -> None:
    """``parallel/context_batch.py`` shards as torch's ring assumes: ``_HeadTailLoadBalancer``'s order."""
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    from lightning_moe_overlap.parallel.context_batch import shard_positions

    torchs = _HeadTailLoadBalancer(seq, cp, "cpu")._generate_indices()[0]
    ours = torch.cat([shard_positions(seq, cp, r) for r in range(cp)])
    assert torch.equal(torchs, ours), _broken("_HeadTailLoadBalancer._generate_indices", "(context_batch)", "reorders")


def test_wrapper_subclass_names() -> None:
    """``make_wrapper_subclass``, ``disabled_torch_function`` and ``tree_map``: a storage-less subclass whose
    operations go through ``__torch_dispatch__`` and come back as plain tensors (as ``float8/rows.py`` relies on)."""
    _require(torch.Tensor, "_make_wrapper_subclass", "torch.Tensor._make_wrapper_subclass", "make_wrapper_subclass")
    _require(torch._C, "_disabled_torch_function_impl", "torch._C._disabled_torch_function_impl",
             "disabled_torch_function")  # fmt: skip

    class Ones(torch.Tensor):
        __torch_function__ = torch_compat.disabled_torch_function()

        @staticmethod
        def __new__(cls, shape):  # noqa: ANN001, ANN205
            return torch_compat.make_wrapper_subclass(cls, shape, dtype=torch.float32, device=torch.device("cpu"))

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
            ones = lambda t: torch.ones(t.shape) if isinstance(t, Ones) else t  # noqa: E731
            return func(*torch_compat.tree_map(ones, args), **torch_compat.tree_map(ones, kwargs or {}))

    out = Ones((2, 3)) + 1
    assert type(out) is torch.Tensor and torch.equal(out, torch.full((2, 3), 2.0)), _broken(
        "torch.Tensor._make_wrapper_subclass", "make_wrapper_subclass", "changed how a wrapper subclass dispatches"
    )
    assert torch_compat.tree_map(lambda x: x * 2, {"a": (1, [2])}) == {"a": (2, [4])}, _broken(
        "torch.utils._pytree.tree_map", "tree_map", "changed"
    )


def test_loss_parallel_enabled() -> None:
    from torch.distributed.tensor.parallel import loss_parallel

    assert not torch_compat.loss_parallel_enabled()
    with loss_parallel():
        assert torch_compat.loss_parallel_enabled(), _broken(
            "torch.distributed.tensor.parallel.loss_parallel", "loss_parallel_enabled",
            "no longer puts nll_loss_forward into DTensor._op_dispatcher._custom_op_handlers",
        )  # fmt: skip
    assert not torch_compat.loss_parallel_enabled()



def test_the_runtime_of_an_action_order_with_one_stage_per_rank() -> None:
    """``pipeline_runtime``: torch's ``_PipelineScheduleRuntime`` over a rank's one stage, running the order it is
    given (what ``1f1b`` with overlap installs)."""
    from types import SimpleNamespace

    stage = SimpleNamespace(num_stages=2, group_size=2, group_rank=1, stage_index=1, is_last=True)
    schedule = torch_compat.pipeline_runtime([stage], 3, lambda out, target: out, scale_grads=False)
    assert torch_compat.pipeline_stages(schedule) == [stage] and torch_compat.pipeline_microbatches(schedule) == 3
    order = {
        r: [torch_compat.pipeline_action(r, "F", j) for j in range(3)]
        + [torch_compat.pipeline_action(r, "B", k) for k in range(3)]
        for r in range(2)
    }
    torch_compat.relower_pipeline_order(schedule, order)
    kinds = [torch_compat.action_kind(a) for a in torch_compat.lowered_pipeline_order(schedule)[1]]
    assert kinds.count("RECV_F") == 3 and kinds.count("SEND_B") == 3 and kinds.count("F") == kinds.count("B") == 3
