"""A short batch (an epoch's last one, whose rows ``num_microbatches`` does not divide) through ``MicroBatchLoop``:
its gradient against one plain full-batch backward, and the auxiliary-loss weights the hooks receive."""

from __future__ import annotations

import pytest
import torch

from lightning_moe_overlap.loop import MicroBatchLoop, StepHooks, split_batch
from lightning_moe_overlap.overlap import CommRuntime, OverlapEngine
from lightning_moe_overlap.step_logs import MicroBatchLogs
from tests.helpers.tolerance import assert_within, reordered_sum_tol
from tests.unit.test_loop import Module, Sequential, _hooks, _model


def _rows_batch(rows: int) -> dict:
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randn(rows, 4, generator=g), "y": torch.randn(rows, 2, generator=g), "tag": "kept"}


@pytest.mark.parametrize("rows,parts", [(5, [2, 1, 1, 1]), (3, [1, 1, 1]), (2, [1, 1]), (7, [2, 2, 2, 1])])
def test_split_of_a_short_batch_is_nearly_even(rows: int, parts: list[int]) -> None:
    micro = split_batch(_rows_batch(rows), 4, short=True)
    assert [m["x"].shape[0] for m in micro] == parts
    assert all(m["tag"] == "kept" for m in micro)
    assert torch.equal(torch.cat([m["x"] for m in micro]), _rows_batch(rows)["x"])


def test_split_of_a_short_batch_needs_one_batch_dimension() -> None:
    batch = {"x": torch.zeros(5, 2), "y": torch.zeros(3, 2)}
    with pytest.raises(ValueError, match=r"a batch dimension of 3 does not split into `num_microbatches=4`"):
        split_batch(batch, 4, short=True)
    with pytest.raises(ValueError, match=r"a batch dimension of 5 does not split"):  # full batches stay strict
        split_batch({"x": torch.zeros(5, 2)}, 4)


def _bounds(model: torch.nn.Sequential, batch: dict) -> tuple[list[torch.Tensor], float]:
    """How far the micro-batched gradients (and loss) may be from one full-batch backward, from float32 arithmetic
    (``tests/helpers/tolerance.py``): the same loss computed on the absolute values (``|x|``, ``|W|``, ``|b|``,
    ``|out| + |y|`` for the residual) bounds every partial sum of either computation, and the longest chain of
    reordered sums and roundings is: layer one (4 inputs + bias), layer two (6 + bias), the residual, the mean
    square's scale (2), the backward through layer two (2 outputs), the sum over the ``rows``, and the micro-batch
    weights (a division, a product and the accumulation: 3): ``rows + 20`` terms. The loss: the same forward chain
    (14) times its absolute-value loss, plus the sums over the ``2 * rows`` squares and the micro-batch weights."""
    (w1, b1), (w2, b2) = ((m.weight.detach().abs(), m.bias.detach().abs()) for m in model)
    x, y = batch["x"], batch["y"]
    rows = x.shape[0]
    h_abs = x.abs() @ w1.T + b1
    res = model(x).detach() - y
    res_abs = h_abs @ w2.T + b2 + y.abs()
    dres_abs = 2 * res_abs / res.numel()  # d(mean square)/d(residual), on absolute values
    dh_abs = dres_abs @ w2
    n = rows + 20
    grads = [dh_abs.T @ x.abs(), dh_abs.sum(0), dres_abs.T @ h_abs, dres_abs.sum(0)]  # w1, b1, w2, b2
    loss_atol = reordered_sum_tol(14, (2 * res.abs() * res_abs).mean().item())
    loss_rtol = reordered_sum_tol(2 * rows + 3, 1.0)
    return [reordered_sum_tol(n, g) for g in grads], loss_atol + loss_rtol * res.square().mean().item()


@pytest.mark.parametrize("engine", ["sequential", "overlap"])
@pytest.mark.parametrize("rows", [5, 3, 2])
def test_short_batch_gradient_equals_one_full_batch_backward(engine: str, rows: int) -> None:
    model, runtime, events = _model(), CommRuntime(), []
    executor = OverlapEngine(runtime, overlap=True) if engine == "overlap" else Sequential()
    hooks = _hooks(model, Module(), events, runtime=runtime if engine == "overlap" else None)
    out = MicroBatchLoop(hooks, executor, num_microbatches=4).step(_rows_batch(rows), 0)
    reference, batch = _model(), _rows_batch(rows)
    loss = (reference(batch["x"]) - batch["y"]).square().mean()  # the independent oracle: one plain backward
    loss.backward()
    grad_bounds, loss_bound = _bounds(reference, batch)
    for (name, got), p, bound in zip(model.named_parameters(), reference.parameters(), grad_bounds, strict=True):
        assert_within(got.grad, p.grad, bound, name)
    assert abs(float(out["loss"]) - float(loss.detach())) <= loss_bound
    assert sum(1 for e in events if e[0] == "forward") == min(rows, 4)


@pytest.mark.parametrize("rows,expected", [(8, []), (5, [0.4, 0.2, 0.2, 0.2, 0.25]), (2, [0.5, 0.5, 0.25])])
def test_auxiliary_loss_weights_follow_the_rows_and_return_to_one_over_m(rows: int, expected: list[float]) -> None:
    scales: list[float] = []
    model, events = _model(), []
    base = _hooks(model, Module(), events)
    hooks = StepHooks(
        zero_grad=base.zero_grad, forward=base.forward, backward=base.backward, sync_gradients=base.sync_gradients,
        capture_logs=lambda: MicroBatchLogs(Module()), aux_loss_scale=scales.append,
    )
    MicroBatchLoop(hooks, Sequential(), num_microbatches=4).step(_rows_batch(rows), 0)
    assert scales == pytest.approx(expected)  # a full batch leaves the scale set at setup (1 / M) alone


def test_loader_rules_name_the_values_and_the_fix() -> None:
    from lightning_moe_overlap.config import OverlapConfig
    from lightning_moe_overlap.validation import check_loader, raise_problems

    with pytest.raises(ValueError, match=r"dataloader's batch_size=6 does not split into `num_microbatches=4`.*"
                       r"among \[2, 3, 6\]"):
        raise_problems(check_loader(OverlapConfig(num_microbatches=4), 6, 100))
    with pytest.raises(ValueError, match=r"\(pp=2\): the epoch's last batch would hold 3 of batch_size=4 rows \(11 "
                       r"samples per data-parallel rank, drop_last=False\).*Set `drop_last=True`"):
        raise_problems(check_loader(OverlapConfig(pp=2, vpp=1, num_microbatches=2), 4, 11))
    # 2 rows would split into 2 parts, but the schedules' shapes are fixed at the first step: refused too
    with pytest.raises(ValueError, match=r"last batch would hold 2 of batch_size=4 rows"):
        raise_problems(check_loader(OverlapConfig(pp=2, vpp=1, num_microbatches=2), 4, 10))
    assert check_loader(OverlapConfig(pp=2, vpp=1, num_microbatches=2), 4, 11, drop_last=True) == []
    assert check_loader(OverlapConfig(pp=2, vpp=1, num_microbatches=2), 4, 12) == []  # every batch full
    assert check_loader(OverlapConfig(num_microbatches=2), 4, 11) == []  # pp = 1 runs a short batch
