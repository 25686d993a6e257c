"""The fused cross-entropy in the models, against the same models with it off (the oracle: their logits and
``F.cross_entropy`` / HF's own ``loss_function``): ``MoEGPT`` and ``HFMoECausalLM`` (tiny qwen3_moe, with and
without the router's auxiliary loss, with ignored labels and padding) over two optimizer steps in one process; the
pipeline chunks (a ``pp = 2`` split built on meta, chained in one process); a Lightning ``Trainer`` fit; and that the
fused models never run their head on the hidden states (no logits).

Tolerances: derived from float32 arithmetic (``tests/helpers/tolerance.py``, :class:`_Bounds`), not fitted to one
machine's kernels: the two models run the same forward up to the head, then compute the loss and the head's backward
with the same sums in other orders (ATen's kernels order them per CPU: ``ATEN_CPU_CAPABILITY``); the layers below
run the same kernels on a hidden-state gradient that differs by that much. Two ways over two steps:

- the models' own AdamW: the unfused model steps, and the fused one takes its parameters before each step, so both
  are compared at the same point (after an AdamW step, parameters that ran apart would not be comparable: AdamW
  divides each gradient entry by its running magnitude, so a rounding-size difference in a near-zero entry becomes
  a visible difference in that parameter, measured up to 6e-5 relative after one step);
- SGD, each model on its own: the parameters after both steps within the learning rate times the gradients' bounds,
  plus the updates' own roundings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from lightning.pytorch import Trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.config.pipeline_layout import build_layout
from lightning_moe_overlap.pipeline.split import SplitModel, split_model
from tests.helpers.tolerance import blocks_of, cross_entropy_tols, logit_terms, sgd_drift

CHUNK = 37  # divides neither the tokens nor the vocabularies
LR = 0.1  # the SGD runs'


def _gpt(fused: bool) -> MoEGPT:
    return MoEGPT(vocab_size=200, hidden_size=32, num_layers=2, num_heads=4, num_experts=4, ffn_hidden_size=32,
                  shared_expert_ffn_hidden_size=16, fused_cross_entropy=fused, cross_entropy_chunk_size=CHUNK)


def _hf(fused: bool, **overrides) -> nn.Module:
    pytest.importorskip("transformers", reason="Requires: transformers>=5")
    from lightning_moe_overlap.demo_hf import HFMoECausalLM

    return HFMoECausalLM("qwen3_moe", config_overrides=overrides, fused_cross_entropy=fused,
                         cross_entropy_chunk_size=CHUNK)


def _tokens(vocab: int, seed: int) -> Tensor:
    return torch.randint(0, vocab, (3, 11), generator=torch.Generator().manual_seed(seed))


def _hf_batch(seed: int) -> dict[str, Tensor]:
    ids = _tokens(128, seed)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt
    mask = torch.ones_like(ids)
    mask[2, -3:] = 0  # padding
    labels[2, -3:] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


@dataclass
class _Bounds:
    """What the fused and the unfused model may differ by, from the reordered sums between them
    (``tests/helpers/tolerance.py``, :func:`cross_entropy_tols`), for a head of ``vocab`` rows and ``width`` columns
    and a loss over at most ``tokens`` positions. ``terms``: the largest ``sum_d |h_d w_vd|`` of a logit, recorded by
    :meth:`watch` on the unfused model's head (the fused one never runs it)."""

    vocab: int
    width: int
    tokens: int
    terms: float = 0.0
    drift: dict[str, float] = field(default_factory=dict)  # per parameter: how far SGD may have moved them apart

    def watch(self, head: nn.Module) -> None:
        def record(module: nn.Module, args: tuple, out: Tensor) -> None:
            self.terms = max(self.terms, logit_terms(args[0], module.weight, module.bias))

        head.register_forward_hook(record)

    def tols(self) -> dict[str, float]:
        return cross_entropy_tols(self.vocab, self.width, self.tokens, self.terms, blocks_of(self.vocab, CHUNK))

    def loss(self, got: Tensor, want: Tensor) -> None:
        tols = self.tols()  # the router's auxiliary loss, added to both, is the same computation in both
        torch.testing.assert_close(got, want, rtol=tols["loss_rtol"], atol=tols["loss_atol"])

    def grad_bound(self, want: Tensor) -> float:
        """``grad_rel`` times the gradient's largest entry. ``grad_rel`` is relative to the sum of the terms'
        absolute values of the head's backward; the layers below run the same kernels in both models, linear in the
        hidden-state gradient, so each parameter's gradient is off by as much relative to its own magnitude, here
        its largest entry (the sum of its terms' absolute values is not at hand through several layers)."""
        return self.tols()["grad_rel"] * want.abs().max().item()

    def grad(self, got: Tensor, want: Tensor, name: str) -> float:
        atol = self.grad_bound(want)
        torch.testing.assert_close(got, want, rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")
        return atol

    def step(self, name: str, param: Tensor, grad: Tensor, grad_bound: float) -> None:
        """An SGD step of both models (:func:`sgd_drift`). The parameters' own difference after a step changes the
        next step's gradients by far less than their bound (``LR`` times a bound some 1e-5 of the gradients, against
        parameters of order 1e-2 to 1)."""
        drift = sgd_drift(LR, grad_bound, param.abs().max().item(), grad.abs().max().item())
        self.drift[name] = self.drift.get(name, 0.0) + drift

    def params(self, got: Tensor, want: Tensor, name: str) -> None:
        torch.testing.assert_close(got, want, rtol=0, atol=self.drift[name], msg=lambda m: f"{name}: {m}")


def _bounds(plain: nn.Module, tokens: int) -> _Bounds:
    """The bounds of the unfused ``MoEGPT`` or ``HFMoECausalLM`` ``plain``, watching its head."""
    head = plain.head if isinstance(plain, MoEGPT) else plain.model.lm_head
    bounds = _Bounds(head.out_features, head.in_features, tokens)
    bounds.watch(head)
    return bounds


def _two_steps_agree(fused: nn.Module, plain: nn.Module, loss_of, batches: list, *, sgd: bool) -> None:
    """Losses and gradients of both models, step by step (see the module's docstring for ``sgd``)."""
    fused.load_state_dict(plain.state_dict())
    bounds = _bounds(plain, batches[0]["input_ids"].numel() if isinstance(batches[0], dict) else batches[0].numel())
    models = (fused, plain)
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR) for m in models] if sgd else [plain.configure_optimizers()]
    for step, batch in enumerate(batches):
        if not sgd:
            fused.load_state_dict(plain.state_dict())
        losses = [loss_of(m, batch) for m in models]
        bounds.loss(losses[0], losses[1])
        for m, loss in zip(models, losses, strict=True):
            m.zero_grad()
            loss.backward()
        for (name, p), q in zip(fused.named_parameters(), plain.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), name
            if q.grad is not None:
                grad_bound = bounds.grad(p.grad, q.grad, f"step {step} grad {name}")
                bounds.step(name, q.detach(), q.grad, grad_bound)
        for opt in optimizers:
            opt.step()
    if sgd:
        for (name, p), q in zip(fused.named_parameters(), plain.parameters(), strict=True):
            bounds.params(p.detach(), q.detach(), name)


OPTIMIZERS = pytest.mark.parametrize("sgd", [False, True], ids=["adamw", "sgd"])


@OPTIMIZERS
def test_moegpt_fused_equals_unfused_over_two_steps(sgd: bool) -> None:
    torch.manual_seed(0)
    _two_steps_agree(_gpt(True), _gpt(False), lambda m, b: m._loss(b), [_tokens(200, 1), _tokens(200, 2)], sgd=sgd)


@OPTIMIZERS
@pytest.mark.parametrize("router_logits", [False, True], ids=["ce", "ce+aux"])
def test_hf_fused_equals_unfused_over_two_steps(router_logits: bool, sgd: bool) -> None:
    fused, plain = _hf(True, output_router_logits=router_logits), _hf(False, output_router_logits=router_logits)
    _two_steps_agree(fused, plain, lambda m, b: m._hf_loss(b), [_hf_batch(1), _hf_batch(2)], sgd=sgd)


def _head_calls(head: nn.Module) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = []
    head.register_forward_hook(lambda module, args, out: shapes.append(tuple(out.shape)))
    return shapes


def test_fused_models_build_no_logits() -> None:
    gpt = _gpt(True)
    calls = _head_calls(gpt.head)
    gpt._loss(_tokens(200, 1)).backward()
    assert calls == []  # the loss reads head.weight; the head module never runs
    assert gpt.predict_step(_tokens(200, 1), 0).shape == (3, 11)  # forward still returns logits
    hf = _hf(True, output_router_logits=True)
    calls = _head_calls(hf.model.lm_head)
    hf._hf_loss(_hf_batch(1)).backward()
    assert calls == [(3, 0, 128)]  # HF's own forward ran its head on no position


def _split(build, fused: bool, state: dict) -> SplitModel:
    with torch.device("meta"):
        model = build(fused)
    split = split_model(model, build_layout(2, 2, 1))
    for rank in range(2):  # as the two ranks would, each its own chunk
        split.materialize(split.chunk_indices_of_rank(rank), "cpu", state_dict=state)
    return split


def _chain(split: SplitModel, batch) -> Tensor:
    args, target = split.prepare_batch(batch)
    kwargs = split.chunk_kwargs(batch) if split.chunk_kwargs is not None else {}
    x = args[0]
    for chunk in split.chunks:
        x = chunk(x, **kwargs)
    return split.loss_fn(x, target)


@pytest.mark.parametrize("kind", ["moegpt", "qwen3_moe"])
def test_last_pipeline_stage_fused_equals_unfused(kind: str) -> None:
    build = _gpt if kind == "moegpt" else _hf
    torch.manual_seed(0)
    state = build(False).state_dict()
    fused, plain = _split(build, True, state), _split(build, False, state)
    batch = _tokens(200, 3) if kind == "moegpt" else _hf_batch(3)
    last = fused.chunks[-1]
    head = last.head if kind == "moegpt" else last.lm_head
    calls = _head_calls(head)
    plain_head = plain.chunks[-1].head if kind == "moegpt" else plain.chunks[-1].lm_head
    positions = (batch if kind == "moegpt" else batch["input_ids"]).numel()
    bounds = _Bounds(plain_head.out_features, plain_head.in_features, positions)
    bounds.watch(plain_head)
    losses = [_chain(s, batch) for s in (fused, plain)]
    assert calls == []
    bounds.loss(losses[0], losses[1])
    for loss in losses:
        loss.backward()
    for c, (a, b) in enumerate(zip(fused.chunks, plain.chunks, strict=True)):
        for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
            if q.grad is not None:
                bounds.grad(p.grad, q.grad, f"chunk {c} {name}")


class _SGDGPT(MoEGPT):
    """``MoEGPT`` with SGD at :data:`LR`; with ``bounds``, each step's gradients feed its SGD drift bounds."""

    bounds: _Bounds | None = None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.bounds is None:
            return
        for name, p in self.named_parameters():
            if p.grad is not None:
                self.bounds.step(name, p.detach(), p.grad, self.bounds.grad_bound(p.grad))


def test_trainer_fit_fused_equals_unfused() -> None:
    data = torch.stack([_tokens(200, s)[0] for s in range(8)])
    params = []
    for fused in (True, False):
        torch.manual_seed(0)
        model = _SGDGPT(vocab_size=200, hidden_size=32, num_layers=2, num_heads=4, num_experts=4, ffn_hidden_size=32,
                        fused_cross_entropy=fused, cross_entropy_chunk_size=CHUNK)
        if not fused:  # the reference: its head runs, its gradients are the bounds' scale
            model.bounds = bounds = _bounds(model, 4 * (data.shape[1] - 1))
        trainer = Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, DataLoader(data, batch_size=4))
        params.append(dict(model.named_parameters()))
    for name, p in params[0].items():
        bounds.params(p.detach(), params[1][name].detach(), name)


def test_hf_fused_refuses_transformed_logits() -> None:
    from lightning_moe_overlap.loss.hf import hf_causal_lm_loss

    model = _hf(True)
    model.model.config.final_logit_softcapping = 30.0
    with pytest.raises(NotImplementedError, match=r"config\.final_logit_softcapping=30\.0.*Rule: .*Fix: leave"):
        hf_causal_lm_loss(model.model, _hf_batch(1))
