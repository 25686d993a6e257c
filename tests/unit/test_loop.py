"""``MicroBatchLoop`` from fake hooks and executors, no strategy and no Trainer: the seam ``loop.py`` offers.

Oracles: the order of the hooks, the split and scaling the hooks see, gradients of the overlapped engine bitwise
equal to a plain sequential executor's and close to one full-batch backward, and ``loop.py``'s own imports.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from lightning_moe_overlap import loop as loop_module
from lightning_moe_overlap.loop import MicroBatchLoop, StepHooks, split_batch
from lightning_moe_overlap.overlap import CommRuntime, OverlapEngine
from lightning_moe_overlap._checks import SAME_ON_EVERY_RANK
from lightning_moe_overlap.step_logs import MicroBatchLogs, mean_of


class Sequential:
    """The simplest executor of the contract: ``F0, B0, F1, B1, ...`` on the calling thread."""

    def __init__(self, events: list | None = None) -> None:
        self.events = events if events is not None else []

    def run(self, forward: Callable, backward: Callable, count: int) -> list[Tensor]:
        losses = []
        for i in range(count):
            losses.append(forward(i))
            backward(i, losses[-1])
        self.events.append(("executor", count))
        return losses


class Module:
    """Stands for the LightningModule: ``log`` is a method the capture shadows for the step."""

    def __init__(self) -> None:
        self.logged: list[tuple] = []

    def log(self, name: str, value, *args, **kwargs) -> None:
        self.logged.append((name, value, args, kwargs))


class CommPoint(torch.autograd.Function):
    """Identity with a hand-over in forward and backward, as a dispatcher's all-to-all does."""

    @staticmethod
    def forward(ctx, x: Tensor, runtime: CommRuntime) -> Tensor:  # noqa: ANN001
        ctx.runtime = runtime
        runtime.handoff()
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # noqa: ANN001
        ctx.runtime.handoff()
        return grad.clone(), None


def _hooks(model: nn.Module, module: Module, events: list, runtime: CommRuntime | None = None) -> StepHooks:
    def forward(micro: dict, batch_idx: int, *rest) -> dict:
        events.append(("forward", micro["x"].shape[0], batch_idx, rest))
        hidden = model[0](micro["x"])
        if runtime is not None:
            hidden = CommPoint.apply(hidden, runtime)
        loss = (model[1](hidden) - micro["y"]).square().mean()
        module.log("loss", loss.detach(), prog_bar=True)
        return {"loss": loss, "tag": micro["tag"]}

    def backward(loss: Tensor) -> None:
        events.append(("backward", float(loss.detach())))
        loss.backward()

    return StepHooks(
        zero_grad=lambda batch_idx: (events.append(("zero_grad", batch_idx)), model.zero_grad()),
        forward=forward,
        backward=backward,
        sync_gradients=lambda: events.append(("sync",)),
        capture_logs=lambda: MicroBatchLogs(module),
    )


def _batch() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(8, 4, generator=g), "y": torch.randn(8, 2, generator=g), "tag": "kept"}


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))


def test_step_calls_the_hooks_in_order_and_scales_each_loss() -> None:
    model, module, events = _model(), Module(), []
    loop = MicroBatchLoop(_hooks(model, module, events), Sequential(events), num_microbatches=4)
    out = loop.step(_batch(), 7, "extra")
    kinds = [e[0] for e in events]
    assert kinds == ["zero_grad"] + ["forward", "backward"] * 4 + ["executor", "sync"]
    assert events[0] == ("zero_grad", 7)
    assert all(e[1:] == (2, 7, ("extra",)) for e in events if e[0] == "forward")  # 8 rows / 4, args passed on
    assert len(module.logged) == 1  # one log per name per step, after the sync
    name, value, args, kwargs = module.logged[0]
    assert name == "loss" and kwargs == {"prog_bar": True}
    backwards = [e[1] for e in events if e[0] == "backward"]  # each micro-batch's loss / 4
    assert float(value) == pytest.approx(sum(backwards), rel=1e-6)  # the logged mean of the 4 losses
    assert float(out["loss"]) == pytest.approx(float(value), rel=1e-6) and out["tag"] == "kept"
    assert not out["loss"].requires_grad
    assert "log" not in vars(module)  # the capture is gone after the step


def test_overlap_engine_as_executor_is_bitwise_equal_to_sequential_and_close_to_full_batch() -> None:
    grads = {}
    for name in ("sequential", "overlap"):
        model, runtime = _model(), CommRuntime()
        executor = OverlapEngine(runtime, overlap=True) if name == "overlap" else Sequential()
        hooks = _hooks(model, Module(), [], runtime=runtime if name == "overlap" else None)
        MicroBatchLoop(hooks, executor, num_microbatches=4).step(_batch(), 0)
        grads[name] = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(grads["overlap"], grads["sequential"]):
        assert torch.equal(a, b)
    model, batch = _model(), _batch()
    (model(batch["x"]) - batch["y"]).square().mean().backward()  # independent reference: one full batch
    for a, p in zip(grads["overlap"], model.parameters()):
        torch.testing.assert_close(a, p.grad)


def test_log_capture_is_removed_when_the_step_fails() -> None:
    module = Module()

    def failing(i: int) -> Tensor:
        raise RuntimeError("boom")

    class Failing:
        def run(self, forward, backward, count):
            return [failing(0)]

    hooks = StepHooks(
        zero_grad=lambda i: None, forward=lambda *a: None, backward=lambda loss: None,
        sync_gradients=lambda: None, capture_logs=lambda: MicroBatchLogs(module),
    )
    with pytest.raises(RuntimeError, match="boom"):
        MicroBatchLoop(hooks, Failing(), 2).step({"x": torch.zeros(2)}, 0)
    assert "log" not in vars(module)


def test_mean_of_values() -> None:
    assert mean_of([torch.tensor(1.0), torch.tensor(2.0)]).item() == 1.5
    assert mean_of([1, 2]).dtype == torch.float32 and mean_of([1, 2]).item() == 1.5
    assert mean_of([torch.tensor(3.0, dtype=torch.bfloat16)]).dtype == torch.bfloat16
    assert mean_of(["metric-a", "metric-b"]) == "metric-b"  # not numbers: the last value, as logged


def test_clear_errors_of_the_step() -> None:
    with pytest.raises(ValueError, match=r"a batch dimension of 3 does not split into `num_microbatches=2`") as odd:
        split_batch({"x": torch.zeros(3, 2)}, 2)
    with pytest.raises(ValueError, match=r"holds no tensor with a batch dimension") as none:
        split_batch({"x": torch.tensor(1.0), "name": "a"}, 2)
    # configuration errors every rank finds alike at its first step: the launcher shows them once (rank 0)
    assert getattr(odd.value, SAME_ON_EVERY_RANK) is True and getattr(none.value, SAME_ON_EVERY_RANK) is True
    hooks = StepHooks(
        zero_grad=lambda i: None, forward=lambda *a: None, backward=lambda loss: None,
        sync_gradients=lambda: None, capture_logs=lambda: MicroBatchLogs(Module()),
    )
    with pytest.raises(TypeError, match=r"must return a loss tensor or a dict with a 'loss' tensor; got NoneType"):
        MicroBatchLoop(hooks, Sequential(), 1).step({"x": torch.zeros(2)}, 0)


def test_loop_module_knows_nothing_of_the_strategy_or_lightnings_loop() -> None:
    tree = ast.parse(inspect.getsource(loop_module))
    imported = [
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    ]
    assert not [m for m in imported if m and ("strategy" in m or m.startswith("lightning.") or m == "lightning")]
    assert "strategy" not in inspect.getsource(loop_module)
