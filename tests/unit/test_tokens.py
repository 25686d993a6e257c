"""The token count of a step (``loss/tokens.py``), the accumulation window's read-ahead (``accumulation.py``) and the
errors of a loss that mixes the two kinds, without a process group.

Oracles: counts written out by hand; Hugging Face's own loss (``ForCausalLMLoss``) for what a count means; the loop
driven with fake hooks and a sequential executor.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_moe_overlap.accumulation import LookaheadLoader, Window
from lightning_moe_overlap.loop import MicroBatchLoop, StepHooks
from lightning_moe_overlap.loss.tokens import StepTokens, TokenScope, count_label_tokens, step_tokens
from lightning_moe_overlap.pipeline.step_loss import StepLoss
from lightning_moe_overlap.step_logs import MicroBatchLogs


def test_count_label_tokens_counts_what_hf_causal_loss_averages() -> None:
    labels = torch.tensor([[5, -100, 7, 8], [-100, -100, -100, -100], [1, 2, -100, 3]])
    # shifted: position i predicts label i + 1 -> labels[:, 1:]: (-100, 7, 8) (-100 x3) (2, -100, 3) -> 4
    assert int(count_label_tokens({"labels": labels, "input_ids": labels.clamp(min=0)})) == 4
    assert int(count_label_tokens({"input_ids": torch.zeros(3, 5, dtype=torch.long)})) == 12
    assert int(count_label_tokens(torch.zeros(2, 7, dtype=torch.long))) == 12
    assert int(count_label_tokens((torch.zeros(2, 7, dtype=torch.long),))) == 12
    # the count is HF's denominator: its mean loss times the count is the sum
    logits = torch.randn(3, 4, 11, generator=torch.Generator().manual_seed(0))
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    mean = F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)
    total = F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100, reduction="sum")
    torch.testing.assert_close(total / count_label_tokens({"labels": labels}), mean)


def test_count_label_tokens_names_the_hook_for_other_batches() -> None:
    with pytest.raises(TypeError, match=r"cannot count the labelled tokens of a batch of type str.*count_loss_tokens"):
        count_label_tokens("text")


def test_step_tokens_outside_a_training_step_is_the_batch_count_and_never_zero() -> None:
    class Module:  # no Trainer
        pass

    labels = torch.full((2, 4), -100)
    assert float(step_tokens(Module(), {"labels": labels})) == 1.0  # no labelled token: 1, so the loss is 0 / 1
    labels[0, 2:] = 3
    assert float(step_tokens(Module(), {"labels": labels})) == 2.0

    class Counting:
        def count_loss_tokens(self, batch) -> int:
            return 17

    assert float(step_tokens(Counting(), object())) == 17.0


def test_token_scope_warns_once_when_the_strategy_could_not_count() -> None:
    scope = TokenScope()
    with scope.step(None, TypeError("a batch of type list")):
        with pytest.warns(UserWarning, match=r"could not count .*a batch of type list.*mean over the micro-batches.*"
                                             r"count_loss_tokens"):  # fmt: skip
            assert scope.take() is None
        assert scope.take() is None  # once
    assert scope.take() is None and scope.calls == 0
    with scope.step(StepTokens(torch.tensor(4.0), 0.5)):
        assert float(scope.take().divisor) == 4.0
    assert scope.calls == 1 and scope.current is None


def test_lookahead_reads_a_window_ahead_and_behaves_as_the_loader() -> None:
    class Loader(list):
        batch_size = 3
        worker_init_fn = None

    inner = Loader(range(5))
    loader = LookaheadLoader(inner, ahead=2)
    assert len(loader) == 5 and loader.batch_size == 3
    loader.worker_init_fn = print  # written through (Lightning sets it)
    assert inner.worker_init_fn is print
    seen, upcoming = [], []
    for batch in loader:  # a consumer without prefetch: each batch trained as it is fetched
        loader.begin_step()
        seen.append(batch)
        upcoming.append(loader.upcoming(2))
    assert seen == [0, 1, 2, 3, 4]
    assert upcoming == [[1, 2], [2, 3], [3, 4], [4], []]
    it = iter(loader)  # a consumer that fetches one batch early (Lightning for a loader without len)
    fetched = [next(it), next(it)]
    loader.begin_step()  # training batch 0 while batch 1 is already fetched
    assert fetched == [0, 1] and loader.upcoming(2) == [1, 2]


def _hooks(grads: list[float], module, token: bool) -> StepHooks:
    weight = torch.ones((), requires_grad=True)

    def forward(micro_batch, batch_idx):
        x = micro_batch.float().sum() * weight
        return x / step_tokens(module, micro_batch) if token else x

    def backward(loss):
        loss.backward()
        grads.append(float(weight.grad))

    return StepHooks(
        zero_grad=lambda i: weight.grad is not None and weight.grad.zero_(), forward=forward, backward=backward,
        sync_gradients=lambda: None, capture_logs=lambda: MicroBatchLogs(module),
        token_loss=lambda batch, token_sum: token_sum,
    )


class _Sequential:
    def run(self, forward, backward, count):
        losses = []
        for i in range(count):
            losses.append(forward(i))
            backward(i, losses[-1])
        return losses


def test_the_loop_back_propagates_token_losses_as_they_are_and_refuses_a_mix() -> None:
    scope = TokenScope()

    class Trainer:
        class strategy:  # noqa: N801 - an attribute, as Lightning's
            token_scope = scope

    class Module:
        _trainer = Trainer()

        def log(self, *args, **kwargs):
            pass

    grads: list[float] = []
    loop = MicroBatchLoop(_hooks(grads, Module(), token=True), _Sequential(), 2, scope)
    window = Window(tokens=StepTokens(torch.tensor(8.0), 0.5))
    batch = torch.ones(4, 3, dtype=torch.long)
    loop.step(batch, 0, window=window)
    assert grads == [6 / 8, 12 / 8]  # each micro-batch's sum of 6 / 8, not / 2 again

    asked = iter([True, False])

    def sometimes(micro_batch, batch_idx):
        return micro_batch.float().sum() / (step_tokens(Module(), micro_batch) if next(asked) else 1)

    hooks = _hooks([], Module(), token=True)
    mixed_hooks = StepHooks(**{**hooks.__dict__, "forward": sometimes, "backward": lambda loss: loss.backward()})
    mixed = MicroBatchLoop(mixed_hooks, _Sequential(), 2, scope)
    with pytest.raises(RuntimeError, match=r"asked for `step_tokens` in some micro-batches.*in every training step"):
        mixed.step(batch.float().requires_grad_(), 0, window=window)


def test_pipeline_step_loss_refuses_an_undeclared_token_loss() -> None:
    scope = TokenScope()

    class Owner:
        class _trainer:  # noqa: N801
            class strategy:  # noqa: N801
                token_scope = scope

    loss_fn = StepLoss(lambda out, tgt: out.sum() / step_tokens(Owner(), {"labels": tgt}), scope, token_loss=False,
                       weight=0.25)  # fmt: skip
    with scope.step(StepTokens(torch.tensor(2.0), 0.25)):
        with pytest.raises(RuntimeError, match=r"asked for `step_tokens`.*token_loss=False.*token_loss=True"):
            loss_fn(torch.ones(2), torch.ones(1, 3, dtype=torch.long))
    declared = StepLoss(lambda out, tgt: out.sum(), scope, token_loss=True, weight=1.0)
    with scope.step(StepTokens(torch.tensor(2.0), 0.25)):
        with pytest.raises(RuntimeError, match=r"did not ask for `step_tokens`"):
            declared(torch.ones(2), None)
    plain = StepLoss(lambda out, tgt: out.sum(), scope, token_loss=False, weight=0.25)
    assert float(plain(torch.ones(2), None)) == 0.5 and float(plain.losses[0]) == 2.0
