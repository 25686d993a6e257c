"""The layout report `check` prints: each model's number of layers, the parameters one process of each pp rank
holds (counted independently here, from the unsplit model's modules), and every error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.config.pipeline_layout import build_layout
from lightning_moe_overlap.pipeline.report import layout_report, placement_for, rank_parameters
from lightning_moe_overlap.pipeline.split import PipelineChunks, split_model
from lightning_moe_overlap.pipeline.splitters import count_layers


def _gpt(num_layers: int = 4) -> nn.Module:
    with torch.device("meta"):
        return MoEGPT(vocab_size=64, hidden_size=32, num_layers=num_layers, num_heads=4, num_experts=4,
                      ffn_hidden_size=32, shared_expert_ffn_hidden_size=16)


def _numel(*modules: nn.Module) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


class _SelfSplitting(nn.Module):
    def __init__(self, num_layers: int | None = None) -> None:
        super().__init__()
        self.stack = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        if num_layers is not None:
            self.pipeline_num_layers = num_layers

    def configure_pipeline(self, layout):
        modules = [nn.Sequential(*(self.stack[i] for i in c.layers)) for c in layout.chunks]
        return PipelineChunks(modules, nn.functional.mse_loss, lambda batch: ((batch[0],), batch[1]))


def test_count_layers_of_each_kind_of_model():
    assert count_layers(_gpt(6)) == 6
    assert count_layers(_SelfSplitting(num_layers=3)) == 3
    gpt = _gpt(4)
    gpt.pipeline_num_layers = 2  # the attribute overrides a built-in count
    assert count_layers(gpt) == 2


def test_count_layers_of_an_hf_decoder_in_a_lightning_module():
    pytest.importorskip("transformers", reason="Requires: transformers>=5")
    from lightning_moe_overlap.demo_hf import HFMoECausalLM

    with torch.device("meta"):
        module = HFMoECausalLM("qwen3_moe", config_overrides={"num_hidden_layers": 3})
    assert count_layers(module) == 3 and count_layers(module.model) == 3


def test_count_layers_errors():
    with pytest.raises(TypeError, match=r"no built-in splitter knows Sequential.*Fix: give the model a "
                                        r"configure_pipeline\(layout\) -> PipelineChunks method and a "
                                        r"`pipeline_num_layers` attribute"):
        count_layers(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(TypeError, match=r"_SelfSplitting cuts itself \(configure_pipeline\) but does not say how "
                                        r"many.*Fix: set `self.pipeline_num_layers = len"):
        count_layers(_SelfSplitting())
    with pytest.raises(ValueError, match=r"_SelfSplitting.pipeline_num_layers=0\. Rule: .* an integer >= 1"):
        count_layers(_SelfSplitting(num_layers=0))


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_rank_parameters_against_the_unsplit_modules(ep):
    model = _gpt(4)
    split = split_model(model, build_layout(4, pp=2, vpp=2))  # rank 0: layers 0, 2 + embedding; rank 1: 1, 3 + head
    experts = [_numel(layer.mlp.experts) for layer in model.layers]
    dense = [_numel(layer) - e for layer, e in zip(model.layers, experts)]
    got = rank_parameters(split, ep)
    assert [r.chunks for r in got] == [(0, 2), (1, 3)]
    assert [r.experts_all for r in got] == [experts[0] + experts[2], experts[1] + experts[3]]
    assert [r.experts for r in got] == [(experts[0] + experts[2]) // ep, (experts[1] + experts[3]) // ep]
    assert got[0].dense == _numel(model.embed) + dense[0] + dense[2]
    assert got[1].dense == _numel(model.norm, model.head) + dense[1] + dense[3]
    assert sum(r.dense + r.experts_all for r in got) == _numel(model)  # every parameter counted once


def test_dualpipev_placement_puts_first_and_last_chunk_on_rank_0():
    assert placement_for("dualpipev") == "v" and placement_for("interleaved_1f1b") == "interleaved"
    split = split_model(_gpt(4), build_layout(4, pp=2, vpp=2, placement=placement_for("dualpipev")))
    assert [r.chunks for r in rank_parameters(split)] == [(0, 3), (1, 2)]


def test_layout_report_text():
    model = _gpt(4)
    split = split_model(model, build_layout(4, pp=2, vpp=None, layout="Ettt|tL"))
    ranks = rank_parameters(split, 2)
    text = layout_report(split, 2, schedule="1f1b").splitlines()
    total = _numel(model)
    assert text[:4] == [
        "Pipeline: 4 layers in pp * vpp = 2 * 1 = 2 chunks, placement 'interleaved', schedule '1f1b'",
        "  pipeline_layout: 'Et*3|tL'",
        "  pp rank 0: chunk 0: Et*3",
        "  pp rank 1: chunk 1: tL",
    ]
    assert text[5] == (
        f"  pp rank 0: {ranks[0].total:,} = dense {ranks[0].dense:,} + experts {ranks[0].experts:,} (of "
        f"{ranks[0].experts_all:,}); {ranks[0].total / total:.1%} of the model's {total:,}"
    )
    assert ranks[0].total > ranks[1].total  # 3 layers against 1
