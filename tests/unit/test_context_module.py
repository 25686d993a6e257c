"""The LightningModule's side of context parallelism (``parallel/context_module.py``, ``apply.apply_cp``), on one
process: the sharding the module asks for, and the refusals with their rules. Oracle: the head-tail positions written
out by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import LightningModule

from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.parallelize.steps import apply_cp, aux_loss_scale
from lightning_moe_overlap.parallel.context_module import ContextParallel
from lightning_moe_overlap.parallel.dims import ParallelDims


def _handle(rank: int) -> ContextParallel:
    return ContextParallel(2, rank, attention=None)  # type: ignore[arg-type]  # shard() does not use it


def test_shard_keeps_the_head_and_tail_chunks_of_shifted_targets():
    tokens_BS = torch.arange(9).unsqueeze(0)
    inputs, targets = tokens_BS[:, :-1], tokens_BS[:, 1:]  # shifted on the whole sequence
    (x, y), positions = _handle(1).shard(inputs, targets)
    assert x.tolist() == [[2, 3, 4, 5]] and y.tolist() == [[3, 4, 5, 6]] and positions.tolist() == [[2, 3, 4, 5]]
    (x, y), _ = _handle(0).shard(inputs, targets)
    assert x.tolist() == [[0, 1, 6, 7]] and y.tolist() == [[1, 2, 7, 8]]


def test_a_sequence_2cp_does_not_divide_is_refused_with_the_rule_and_a_length():
    rule = r"`MoEOverlapStrategy\(cp=2\)` \(rule `cp-divides-sequence`.*Sequence length 10 is not divisible by 4.*12"
    with pytest.raises(ValueError, match=rule):
        _handle(0).shard(torch.zeros(2, 10, dtype=torch.long))


def test_a_module_without_the_attribute_is_refused_at_cp2():
    mesh = SimpleNamespace(dims=SimpleNamespace(cp=2))
    with pytest.raises(NotImplementedError, match=r"rule `cp-model`.*`LightningModule` declares no `context_parallel`"):
        apply_cp(LightningModule(), mesh)  # type: ignore[arg-type]
    assert apply_cp(LightningModule(), SimpleNamespace(dims=SimpleNamespace(cp=1))) is None  # type: ignore[arg-type]


def test_moegpt_declares_the_attribute_unset():
    assert MoEGPT(num_layers=1, num_experts=2).context_parallel is None


def test_aux_loss_weight_is_times_cp():
    dims = ParallelDims.from_world_size(4, cp=2, ep=2)
    assert aux_loss_scale(4, dims, pipelined=False) == 0.5
    assert aux_loss_scale(4, ParallelDims.from_world_size(4, ep=2), pipelined=False) == 0.25


def test_pipeline_chunks_that_do_not_shard_their_batches_are_refused_at_cp2():
    """At pp > 1 the splitter's ``prepare_batch`` gives the chunks their inputs: chunks that do not declare that it
    shards them over cp (``PipelineChunks.cp_sharded``) are refused before anything is built, naming the rule and
    the fix; the built-in splitters declare it."""
    from lightning_moe_overlap.config.pipeline_layout import build_layout
    from lightning_moe_overlap.pipeline.split import split_model

    model = MoEGPT(num_layers=2)
    split = split_model(model, build_layout(2, pp=2, vpp=1))
    assert split.cp_sharded  # MoEGPT's own configure_pipeline shards with its context_parallel handle
    split.cp_sharded = False  # as a user's configure_pipeline that does not say so
    dims = ParallelDims.from_world_size(4, cp=2, pp=2, ep=2)
    mesh = SimpleNamespace(dims=dims)
    with pytest.raises(NotImplementedError, match=r"cp=2, pp=2.*rule `cp-pipeline-chunks`.*`MoEGPT`.*cp_sharded=True"):
        apply_cp(model, mesh, SimpleNamespace(split=split))  # type: ignore[arg-type]
