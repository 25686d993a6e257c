"""A model the strategy prepared once is taken as it is by a later run with the same layout, and refused with another;
a model made expert-parallel outside the strategy is refused with the fix."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_moe_overlap.config import OverlapConfig
from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.moe.adapters import expert_parallel_modules
from lightning_moe_overlap.moe.ep import apply_expert_parallel
from lightning_moe_overlap.parallel import ParallelDims
from lightning_moe_overlap.parallelize.prepared_model import PreparedModel, adopt, check_same_layout, record

DIMS = ParallelDims(world_size=2, dp=2, ep=2)


def _prepared(config: OverlapConfig) -> PreparedModel:
    return PreparedModel(config, DIMS, None, None, None, None, None, None)  # type: ignore[arg-type]


def test_a_run_may_change_only_its_own_settings():
    prepared = _prepared(OverlapConfig(ep=2, num_microbatches=2))
    check_same_layout(prepared, OverlapConfig(ep=2, num_microbatches=4, overlap=False), DIMS, "`S`")
    with pytest.raises(NotImplementedError, match=r"another layout: ep=4 \(prepared with 2\).*load the trained "
                       r"weights into it from a checkpoint"):
        check_same_layout(prepared, OverlapConfig(ep=4, num_microbatches=2), DIMS, "`S`")
    with pytest.raises(NotImplementedError, match=r"another layout: world_size=4.*\(prepared on world_size=2"):
        check_same_layout(prepared, OverlapConfig(ep=2, num_microbatches=2), ParallelDims(4, dp=4, ep=2), "`S`")


def test_fp8_and_the_fsdp_policy_are_part_of_the_layout_and_the_run_settings_are_not():
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    prepared = _prepared(OverlapConfig(ep=2, shard="full", fp8="rowwise", fsdp_mp_policy=bf16))
    same = OverlapConfig(ep=2, shard="full", fp8="rowwise",
                         fsdp_mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                         checkpoint_format="consolidated", timeout=60, optimizer_cpu_offload=True)  # fmt: skip
    check_same_layout(prepared, same, DIMS, "`S`")
    with pytest.raises(NotImplementedError, match=r"fp8=None \(prepared with 'rowwise'\)"):
        check_same_layout(prepared, OverlapConfig(ep=2, shard="full", fsdp_mp_policy=bf16), DIMS, "`S`")
    with pytest.raises(NotImplementedError, match=r"fsdp_mp_policy=None \(prepared with MixedPrecisionPolicy"):
        check_same_layout(prepared, OverlapConfig(ep=2, shard="full", fp8="rowwise"), DIMS, "`S`")


def test_the_record_lives_on_the_model_outside_its_state():
    model = MoEGPT(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2, num_experts=2, ffn_hidden_size=8)
    keys = set(model.state_dict())
    prepared = _prepared(OverlapConfig())
    record(model, prepared)
    assert adopt(model, OverlapConfig(), DIMS, "`S`") is prepared and set(model.state_dict()) == keys
    fresh = MoEGPT(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2, num_experts=2)
    assert adopt(fresh, OverlapConfig(), DIMS, "`S`") is None


def test_a_model_made_expert_parallel_outside_the_strategy_is_refused():
    model = MoEGPT(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2, num_experts=2, ffn_hidden_size=8)
    apply_expert_parallel(model, None)
    assert expert_parallel_modules(model) == ["layers.0.mlp.experts"]
    with pytest.raises(RuntimeError, match=r"`S`: `MoEGPT` already has expert-parallel experts "
                       r"\(layers\.0\.mlp\.experts\).*Pass the model as built, before `apply_expert_parallel`"):
        adopt(model, OverlapConfig(), DIMS, "`S`")
