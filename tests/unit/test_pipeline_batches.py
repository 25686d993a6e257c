"""The batches the built-in splitters take at pp > 1, in one process: chained HF chunks fed a dict batch (SFT labels,
padding mask, position ids) give HF's own ``forward(**batch).loss`` bitwise; every refused batch names its type, its
keys and the hook; ``from_pretrained`` under the strategy's meta context is built on meta with its weights declared,
and loads with the opt-out."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.hf import HFWeights
from lightning_moe_overlap.config.pipeline_layout import build_layout
from lightning_moe_overlap.pipeline.split import PipelineChunks, split_model

transformers = pytest.importorskip("transformers", reason="Requires: transformers>=5")

B, S, VOCAB = 4, 8, 128


@pytest.fixture(scope="module")
def hf():
    """A tiny HF Qwen3-MoE (4 layers) in a LightningModule and its split at pp=2, vpp=2."""
    from lightning_moe_overlap.demo_hf import HFMoECausalLM

    model = HFMoECausalLM("qwen3_moe", config_overrides={"num_hidden_layers": 4})
    return model, split_model(model, build_layout(4, 2, 2))


def _sft_batch() -> dict[str, torch.Tensor]:
    ids_BS = torch.randint(2, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))
    mask_BS = torch.ones(B, S, dtype=torch.long)
    mask_BS[0, :3] = 0  # left padding
    mask_BS[1, :1] = 0
    labels_BS = ids_BS.clone()
    labels_BS[:, :4] = -100  # the prompt
    labels_BS[mask_BS == 0] = -100
    position_BS = (mask_BS.cumsum(1) - 1).clamp(min=0)
    position_BS[3] = torch.arange(S) % 5  # restarts: relative positions that differ from the default's
    return {"input_ids": ids_BS, "labels": labels_BS, "attention_mask": mask_BS, "position_ids": position_BS}


def _chained_loss(split, batch) -> torch.Tensor:
    args, target, kwargs = split.step_inputs(batch)
    x = args[0]
    for chunk in split.chunks:
        x = chunk(x, **kwargs)
    return split.loss_fn(x, target)


def test_hf_chunks_take_dict_list_and_tensor_batches_as_hf_forward_does(hf):
    model, split = hf
    full = _sft_batch()
    no_positions = {k: v for k, v in full.items() if k != "position_ids"}
    ids = full["input_ids"]
    cases = [  # (batch, HF's own forward's arguments)
        (full, full),
        (no_positions, no_positions),
        ({"input_ids": ids, "labels": full["labels"]}, {"input_ids": ids, "labels": full["labels"]}),
        ([ids], {"input_ids": ids, "labels": ids}),
        ((ids,), {"input_ids": ids, "labels": ids}),
        (ids, {"input_ids": ids, "labels": ids}),
    ]
    with torch.no_grad():
        losses = []
        for batch, hf_kwargs in cases:
            got, want = _chained_loss(split, batch), model.model(**hf_kwargs).loss
            assert torch.equal(got, want), (sorted(hf_kwargs), got, want)
            losses.append(float(got))
    assert len({losses[0], losses[1], losses[2], losses[3]}) == 4  # positions, mask and labels each change the loss


@pytest.mark.parametrize(
    "batch,match",
    [
        ({"input_ids": torch.zeros(2, 4, dtype=torch.long), "token_type_ids": torch.zeros(2, 4)},
         r"got a dict with keys \['input_ids', 'token_type_ids'\] \(keys it does not know: \['token_type_ids'\]\)"),
        ({"labels": torch.zeros(2, 4, dtype=torch.long)}, r"got a dict with keys \['labels'\]\. Rule"),
        ((torch.zeros(2, 4), torch.zeros(2, 4)), r"got a tuple of 2 item\(s\) \(Tensor, Tensor\)"),
        ({"input_ids": [[1, 2]]}, r"got a dict with keys \['input_ids'\]"),
        ("text", r"got a str\. Rule"),
        (torch.zeros(8, dtype=torch.long), r"got a tensor of shape \[8\]"),
    ],
)  # fmt: skip
def test_error_hf_unsupported_batch(hf, batch, match):
    _, split = hf
    with pytest.raises(TypeError, match=match + r".*configure_pipeline\(layout\).*own prepare_batch"):
        split.step_inputs(batch)


def test_error_hf_batch_shapes(hf):
    _, split = hf
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "attention_mask": torch.ones(2, 3, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"shapes \{'input_ids': \[2, 4\], 'attention_mask': \[2, 3\]\}"):
        split.step_inputs(batch)


def test_moegpt_takes_tensor_and_one_tensor_list():
    with torch.device("meta"):
        model = MoEGPT(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, num_experts=4, ffn_hidden_size=8)
    split = split_model(model, build_layout(2, 2, 1))
    tokens = torch.randint(0, 64, (2, 9))
    for batch in (tokens, [tokens], (tokens,)):
        (inputs,), target, kwargs = split.step_inputs(batch)
        assert torch.equal(inputs, tokens[:, :-1]) and torch.equal(target, tokens[:, 1:]) and kwargs == {}
    with pytest.raises(TypeError, match=r"MoEGPT got a dict with keys \['input_ids'\].*configure_pipeline"):
        split.step_inputs({"input_ids": tokens})


def test_error_custom_prepare_batch_returns_no_tensors():
    with torch.device("meta"):
        model = MoEGPT(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, num_experts=4, ffn_hidden_size=8)

    def splitter(m, layout):
        chunks = split_model(m, layout)
        return PipelineChunks(chunks.chunks, chunks.loss_fn, lambda batch: (batch["x"], batch["y"]))

    split = split_model(model, build_layout(2, 2, 1), splitter=splitter)
    with pytest.raises(TypeError, match=r"prepare_batch returned tuple\[list\[int\], Tensor\].*Rule: prepare_batch"):
        split.step_inputs({"x": [1], "y": torch.zeros(2)})


# -- from_pretrained in configure_model (pp > 1 builds under the meta device) ------------------------------------
class _Loads(LightningModule):
    def __init__(self, path: str, on_meta: bool) -> None:
        super().__init__()
        self.path = path
        self.build_on_meta = on_meta

    def configure_model(self) -> None:
        self.model = transformers.AutoModelForCausalLM.from_pretrained(self.path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, torch.Tensor]]:
    from lightning_moe_overlap.demo_hf import build_hf_model

    path = str(tmp_path_factory.mktemp("pretrained") / "qwen3_moe")
    model = build_hf_model("qwen3_moe")
    model.save_pretrained(path)
    return path, model.state_dict()


@pytest.mark.parametrize("pp", [1, 2])
def test_from_pretrained_under_the_meta_context_is_built_on_meta_with_its_weights_declared(saved, pp):
    strategy = MoEOverlapStrategy(pp=pp, num_microbatches=2)
    module = _Loads(saved[0], on_meta=True)
    strategy.connect(module)
    with strategy.model_sharded_context():  # recognised (tests/unit/test_from_pretrained_meta.py): no error
        module.configure_model()
    assert all(p.is_meta for p in module.model.parameters())
    assert module.hf_weights == HFWeights(saved[0], prefix="model.")


@pytest.mark.parametrize("pp", [1, 2])
def test_from_pretrained_with_the_opt_out_loads_the_saved_weights(saved, pp):
    path, state = saved
    strategy = MoEOverlapStrategy(pp=pp, num_microbatches=2)
    module = _Loads(path, on_meta=False)
    strategy.connect(module)
    with strategy.model_sharded_context():
        module.configure_model()
    loaded = module.model.state_dict()
    assert loaded.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key


def test_the_former_opt_out_name_still_works_with_a_warning(saved):
    class Former(_Loads):
        pipeline_build_on_meta = False

    module = Former(saved[0], on_meta=False)
    del module.build_on_meta  # only the former name
    strategy = MoEOverlapStrategy(pp=1)
    strategy.connect(module)
    with pytest.warns(FutureWarning, match=r"`Former.pipeline_build_on_meta = False` is deprecated.*Rename it to "
                                           r"`build_on_meta = False`"):  # fmt: skip
        with strategy.model_sharded_context():
            assert torch.empty(1).device.type == "cpu"
