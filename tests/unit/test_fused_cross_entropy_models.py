"""The fused cross-entropy in the models, against the same models with it off (the oracle: their logits and
``F.cross_entropy`` / HF's own ``loss_function``): ``MoEGPT`` and ``HFMoECausalLM`` (tiny qwen3_moe, with and
without the router's auxiliary loss, with ignored labels and padding) over two optimizer steps in one process; the
pipeline chunks (a ``pp = 2`` split built on meta, chained in one process); a Lightning ``Trainer`` fit; and that the
fused models never run their head on the hidden states (no logits).

Everything within 1e-6: the loss relative, each gradient and parameter relative to its largest entry (the unfused
float32 loss's own rounding is of that size). Two ways over two steps:

- the models' own AdamW: the unfused model steps, and the fused one takes its parameters before each step, so both
  are compared at the same point (after an AdamW step, parameters that ran apart would not be comparable at 1e-6:
  AdamW divides each gradient entry by its running magnitude, so a 1e-7 difference in a near-zero entry becomes a
  visible difference in that parameter, measured up to 6e-5 relative after one step);
- SGD, each model on its own: the parameters after both steps within 1e-6 too.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.pipeline.layout import build_layout
from lightning_moe_overlap.pipeline.split import SplitModel, split_model

CHUNK = 37  # divides neither the tokens nor the vocabularies


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


def _close(got: Tensor, want: Tensor, name: str) -> None:
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * scale, msg=lambda m: f"{name}: {m}")


def _two_steps_agree(fused: nn.Module, plain: nn.Module, loss_of, batches: list, *, sgd: bool) -> None:
    """Losses and gradients of both models, step by step (see the module's docstring for ``sgd``)."""
    fused.load_state_dict(plain.state_dict())
    models = (fused, plain)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models] if sgd else [plain.configure_optimizers()]
    for step, batch in enumerate(batches):
        if not sgd:
            fused.load_state_dict(plain.state_dict())
        losses = [loss_of(m, batch) for m in models]
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0)
        for m, loss in zip(models, losses, strict=True):
            m.zero_grad()
            loss.backward()
        for (name, p), q in zip(fused.named_parameters(), plain.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), name
            if q.grad is not None:
                _close(p.grad, q.grad, f"step {step} grad {name}")
        for opt in optimizers:
            opt.step()
    if sgd:
        for (name, p), q in zip(fused.named_parameters(), plain.parameters(), strict=True):
            _close(p.detach(), q.detach(), name)


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
    losses = [_chain(s, batch) for s in (fused, plain)]
    assert calls == []
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0)
    for loss in losses:
        loss.backward()
    for c, (a, b) in enumerate(zip(fused.chunks, plain.chunks, strict=True)):
        for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
            if q.grad is not None:
                _close(p.grad, q.grad, f"chunk {c} {name}")


class _SGDGPT(MoEGPT):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_trainer_fit_fused_equals_unfused() -> None:
    data = torch.stack([_tokens(200, s)[0] for s in range(8)])
    params = []
    for fused in (True, False):
        torch.manual_seed(0)
        model = _SGDGPT(vocab_size=200, hidden_size=32, num_layers=2, num_heads=4, num_experts=4, ffn_hidden_size=32,
                        fused_cross_entropy=fused, cross_entropy_chunk_size=CHUNK)
        trainer = Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, DataLoader(data, batch_size=4))
        params.append(dict(model.named_parameters()))
    for name, p in params[0].items():
        _close(p.detach(), params[1][name].detach(), name)


def test_hf_fused_refuses_transformed_logits() -> None:
    from lightning_moe_overlap.loss.hf import hf_causal_lm_loss

    model = _hf(True)
    model.model.config.final_logit_softcapping = 30.0
    with pytest.raises(NotImplementedError, match=r"config\.final_logit_softcapping=30\.0.*Rule: .*Fix: leave"):
        hf_causal_lm_loss(model.model, _hf_batch(1))
