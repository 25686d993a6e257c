"""Every validation rule: the message names the values, the rule and the fix; warnings do not raise."""

from __future__ import annotations

import pytest

from lightning_moe_overlap.config import OverlapConfig
from lightning_moe_overlap.validation import (
    Problem,
    check_config,
    check_flex,
    check_machine,
    check_model,
    check_trainer,
    check_world,
    raise_problems,
    rule_torch_version,
    with_rule,
)


def _raise(problems):
    raise_problems(problems)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"ep": 0}, ValueError, r"`ep=0` must be a positive integer"),
        ({"vpp": 0}, ValueError, r"`vpp=0` must be None or a positive integer"),
        ({"num_microbatches": 0}, ValueError, r"`num_microbatches=0` must be a positive integer"),
        ({"dispatcher": "ring"}, ValueError, r"`dispatcher='ring'` is not one of \['alltoall', 'allgather', 'flex'\]"),
        ({"token_drop_policy": "random"}, ValueError, r"token_drop_policy='random' is not one of \['probs', 'position'\]"),
        ({"start_method": "thread"}, ValueError, r"`start_method='thread'` is not one of"),
        ({"dispatcher": "flex", "flex_backend": "hybridep"}, ValueError, r"`flex_backend='hybridep'` is not one of"),
        ({"capacity_factor": 0.0}, ValueError, r"capacity_factor=0.0 must be None \(dropless\) or a positive number"),
        ({"deepep_num_sms": 7}, ValueError, r"`deepep_num_sms=7` must be a positive even integer"),
        ({"flex_backend": "deepep"}, ValueError, r"`flex_backend='deepep'` does nothing with `dispatcher='alltoall'`"),
        ({"shared_expert_overlap": True}, ValueError, r"`shared_expert_overlap=True` conflicts with `overlap=True`"),
        ({"shared_expert_overlap": True, "overlap": None, "num_microbatches": 2}, ValueError,
         r"conflicts with `overlap=True` \(on by default with num_microbatches=2\): the dispatch overlap"),
        ({"pp": 2}, ValueError, r"'1f1b'` needs at least one micro-batch per stage.*Use num_microbatches >= 2"),
        ({"pp": 2, "vpp": 2, "pipeline_schedule": "zero_bubble", "num_microbatches": 2}, NotImplementedError,
         r"Overlap with `zero_bubble`: its backwards are split"),
        (
            {"pp": 2, "vpp": 2, "num_microbatches": 3},
            ValueError,
            r"needs num_microbatches a multiple of pp, got 3 micro-batches and pp=2\. Use 2 or 4",
        ),
        ({"pp": 2, "vpp": 3, "pipeline_schedule": "dualpipev", "num_microbatches": 6}, ValueError, r"Set vpp=2"),
        ({"pipeline_schedule": "gpipe"}, ValueError, r"`pipeline_schedule='gpipe'` is not one of \['1f1b'"),
        (
            {"pp": 2, "vpp": 2, "pipeline_layout": "Et|t|tL", "num_microbatches": 4},
            ValueError,
            r"`pipeline_layout='Et\|t\|tL'` has 3 chunks; it needs pp \* vpp = 4",
        ),
        ({"pp": 2, "pipeline_layout": "Et)|tL"}, ValueError, r"'\)' at position 2 has no matching '\('"),
        ({"alltoall_dedup": "yes"}, TypeError, r"`alltoall_dedup='yes'` is a str; .*Pass True or False \(default\)"),
        ({"alltoall_static": 1}, TypeError, r"`alltoall_static=1` is an int; .*Pass True or False \(default\)"),
        (
            {"alltoall_static": True, "dispatcher": "allgather"},
            ValueError,
            r"`alltoall_static=True` with dispatcher='allgather'.*Use dispatcher='alltoall', or alltoall_static=False",
        ),
        ({"alltoall_static": True, "alltoall_dedup": True}, ValueError, r"with alltoall_dedup=True .*alltoall_dedup="),
        ({"alltoall_static": True, "expert_backend": "te"}, ValueError, r"with expert_backend='te' .*'torch'"),
        ({"alltoall_static": True, "fp8": "tensorwise"}, ValueError, r"with fp8='tensorwise' .*Use fp8=None"),
        ({"tp": 2, "sequence_parallel": False}, ValueError, r"`tp=2` with `sequence_parallel=False`: the MoE blocks"),
        ({"shard": "zero3"}, ValueError, r"`shard='zero3'` is not one of \['none', 'optimizer', 'full'\]"),
        (
            {"shard": "full", "expert_backend": "te"},
            NotImplementedError,
            r"`shard='full'` with `expert_backend='te'`.*Set `shard='none'`",
        ),
    ],
)
def test_validation_config_rules(kwargs, error, match):
    with pytest.raises(error, match=match):
        _raise(check_config(OverlapConfig(**kwargs)))


@pytest.mark.parametrize("shard", ["optimizer", "full"])
def test_sharding_at_pp2_is_accepted_with_what_composes_with_it(shard):
    """Sharded pipeline chunks (docs/sharding.md, "With pipeline parallelism"), with the early reduction, optimizer
    offload and FP8: no rule refuses or warns."""
    config = OverlapConfig(pp=2, vpp=2, num_microbatches=4, shard=shard, overlap_grad_reduce=True,
                           optimizer_cpu_offload=True, fp8="tensorwise")  # fmt: skip
    assert check_config(config) == []


def test_validation_lists_every_problem_at_once():
    problems = check_config(OverlapConfig(ep=0, dispatcher="ring", flex_backend="deepep"))
    assert [p.rule for p in problems if p.is_error] == ["sizes", "choices", "flex-backend-without-flex"]
    with pytest.raises(ValueError, match=r"3 problems:\n  1\. .*`ep=0`.*\n  2\. .*'ring'.*\n  3\. .*does nothing"):
        _raise(problems)


def test_validation_good_configs_pass_silently(recwarn):
    _raise(check_config(OverlapConfig(ep=8, num_microbatches=4)))
    _raise(check_config(OverlapConfig(dispatcher="flex", flex_backend="deepep", num_microbatches=2)))
    _raise(check_config(OverlapConfig(overlap=False, shared_expert_overlap=True, delay_wgrad=True)))
    _raise(check_config(OverlapConfig(dispatcher="allgather", num_microbatches=2)))
    _raise(check_config(OverlapConfig(alltoall_dedup=True, num_microbatches=2)))
    _raise(check_config(OverlapConfig(alltoall_static=True, capacity_factor=1.25, num_microbatches=2)))
    _raise(check_config(OverlapConfig(pp=2, vpp=2, num_microbatches=4)))
    _raise(check_config(OverlapConfig(pp=2, num_microbatches=4, pipeline_layout="Et|t|t|tL")))  # vpp from the layout
    _raise(check_config(OverlapConfig(pp=2, pipeline_schedule="dualpipev", vpp=2, num_microbatches=4)))
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"ep": 8, "vpp": 2}, r"`vpp=2` with `pp=1`: there is no pipeline, so the setting is ignored"),
        ({"pipeline_schedule": "dualpipev"}, r"`pipeline_schedule='dualpipev'` with `pp=1`: there is no pipeline"),
        ({"num_microbatches": 1}, r"`overlap=True` with `num_microbatches=1`: there is no second micro-batch"),
        (
            {"alltoall_dedup": True, "dispatcher": "allgather", "num_microbatches": 2},
            r"`alltoall_dedup=True` does nothing with `dispatcher='allgather'`.*use `dispatcher='alltoall'`",
        ),
    ],
)
def test_validation_config_warnings(kwargs, match):
    with pytest.warns(UserWarning, match=match):
        _raise(check_config(OverlapConfig(**kwargs)))


def test_a_warning_names_its_rule_once():
    with pytest.warns(UserWarning) as caught:
        _raise(check_config(OverlapConfig(num_microbatches=1)))
    (message,) = [str(w.message) for w in caught if "num_microbatches=1" in str(w.message)]
    rule = next(p.rule for p in check_config(OverlapConfig(num_microbatches=1)) if not p.is_error)
    assert message.endswith(f"(rule `{rule}`, docs/validation.md)") and message.count(f"`{rule}`") == 1
    named = Problem("some-rule", "`x=1`: see rule `some-rule`; set x=2.")
    assert with_rule(named) == named.message


def test_validation_torch_version_rule():
    with pytest.raises(RuntimeError, match=r"`overlap=True` needs torch>=2.6 \(found 2.5.1\+cu124\)"):
        _raise(rule_torch_version(OverlapConfig(), version="2.5.1+cu124"))
    assert rule_torch_version(OverlapConfig(overlap=False), version="2.5.1") == []
    assert rule_torch_version(OverlapConfig(), version="2.13.0+cpu") == []


def test_overlap_default_follows_the_schedule():
    """None: on with several micro-batches; at pp > 1 only with DualPipeV (interleaved 1F1B's pairs make the pp
    ranks take turns, so it overlaps only when asked)."""
    assert OverlapConfig(overlap=None, num_microbatches=2).overlap is True
    assert OverlapConfig(overlap=None, num_microbatches=1).overlap is False
    assert OverlapConfig(overlap=None, pp=2, num_microbatches=4).overlap is False  # 1f1b
    assert OverlapConfig(overlap=None, pp=2, vpp=2, num_microbatches=4).overlap is False  # interleaved_1f1b
    assert OverlapConfig(overlap=None, pp=2, vpp=2, num_microbatches=4, pipeline_schedule="dualpipev").overlap
    zero_bubble = OverlapConfig(overlap=None, pp=2, vpp=2, num_microbatches=4, pipeline_schedule="zero_bubble")
    assert zero_bubble.overlap is False
    layout = OverlapConfig(overlap=None, pp=2, num_microbatches=4, pipeline_layout="Et|t|t|tL")
    assert (layout.resolved_vpp, layout.resolved_schedule, layout.overlap) == (2, "interleaved_1f1b", False)
    assert OverlapConfig(overlap=None, pp=2, pipeline_layout="Et)").overlap is False  # reported by validation


def test_validation_world_rules():
    with pytest.raises(ValueError, match=r"world_size=6 \(devices x num_nodes\) is not a multiple of pp\*cp\*tp=4"):
        _raise(check_world(OverlapConfig(tp=2, pp=2, vpp=1), 6))
    with pytest.raises(ValueError, match=r"ep=8 does not divide dp\*cp\*tp=4 .*Valid ep values here: \[1, 2, 4\]"):
        _raise(check_world(OverlapConfig(ep=8, num_microbatches=2), 4))
    with pytest.warns(UserWarning, match=r"`overlap=True` with `ep=1`: no all-to-all crosses processes"):
        _raise(check_world(OverlapConfig(num_microbatches=2), 4))
    assert check_world(OverlapConfig(ep=8, num_microbatches=2), 8) == []
    assert check_world(OverlapConfig(ep=0), 8) == []  # reported once, by check_config


def test_validation_machine_rules():
    with pytest.raises(ImportError, match=r"`dispatcher='flex'` \(backend 'deepep'\) needs .*a CUDA device.*\[deepep\]"):
        _raise(check_machine(OverlapConfig(dispatcher="flex"), "cpu", cuda_available=False))
    with pytest.raises(ValueError, match=r"`process_group_backend='nccl'` needs CUDA devices, but the accelerator is 'cpu'"):
        _raise(check_machine(OverlapConfig(process_group_backend="nccl"), "cpu", cuda_available=False))
    assert check_machine(OverlapConfig(process_group_backend="gloo"), "cpu", cuda_available=False) == []


def test_validation_model_rules():
    with pytest.raises(ValueError, match=r"`layers.1.mlp.experts` has num_experts=6, which ep=4 does not divide .*\[1, 2\]"):
        _raise(check_model(OverlapConfig(ep=4), {"layers.0.mlp.experts": 8, "layers.1.mlp.experts": 6}))
    # the suggestions satisfy every rule at once: 6 experts on 4 processes (dp*cp=4) allow only ep in [1, 2]
    with pytest.raises(ValueError, match=r"Choose ep among \[1, 2\] \(the values that divide every block's experts and dp\*cp\*tp=4\)"):
        _raise(check_model(OverlapConfig(ep=4), {"experts": 6}, ep_span=4))
    with pytest.warns(UserWarning, match=r"`ep=2` but the model has no MoE block"):
        _raise(check_model(OverlapConfig(ep=2), {}))
    assert check_model(OverlapConfig(ep=4), {"a": 8, "b": 16}) == []
    assert check_model(OverlapConfig(ep=1), {}) == []


def test_validation_trainer_rules():
    assert check_trainer(OverlapConfig(num_microbatches=2), automatic_optimization=True) == []
    with pytest.raises(NotImplementedError, match=r"manual optimization .* is not supported"):
        _raise(check_trainer(OverlapConfig(), automatic_optimization=False))


@pytest.mark.parametrize(
    "ep,per_node,match",
    [
        (1, 8, r"`dispatcher='flex'` with `ep=1` \(devices per node=8\) \(ep=1 moves no token between processes\)"),
        (6, 6, r"`ep=6` \(devices per node=6\): DeepEP's intranode kernels run on \[2, 4, 8\] ranks of one node"),
        (3, None, r"`ep=3` \(devices per node unknown\).*Set `ep` to one of \[2, 4, 8\]"),
        (12, 8, r"`ep=12` \(devices per node=8\) spans nodes: .*need 8 GPUs per node.*config for ep in \[16, 24, 32, "
                r"48, 64, 96, 128, 144, 160\] only"),
        (40, 8, r"`ep=40` \(devices per node=8\) spans nodes: .*config for ep in \[16, 24, "),  # a multiple of 8
        (72, None, r"`ep=72` \(devices per node unknown\) spans nodes"),
        (8, 4, r"`ep=8` \(devices per node=4\) spans nodes"),
        (16, 4, r"`ep=16` \(devices per node=4\) spans nodes.*or `dispatcher='alltoall'`"),
        (4, 6, r"`ep=4` \(devices per node=6\) spans nodes"),  # ranks 4-7 straddle two nodes
    ],
)
def test_validation_flex_ep_size(ep, per_node, match):
    cfg = OverlapConfig(dispatcher="flex", ep=ep, num_microbatches=2)
    with pytest.raises(ValueError, match=match):
        _raise(check_flex(cfg, devices_per_node=per_node))


@pytest.mark.parametrize(
    "ep,per_node", [(2, 8), (4, 8), (8, 8), (8, None), (16, 8), (24, 8), (64, 8), (144, 8), (160, None), (2, 2), (4, 4)]
)
def test_validation_flex_ep_sizes_deepep_runs(ep, per_node):
    assert check_flex(OverlapConfig(dispatcher="flex", ep=ep), devices_per_node=per_node) == []
    # Other dispatchers have no such rule.
    assert check_flex(OverlapConfig(dispatcher="alltoall", ep=ep + 1), devices_per_node=per_node) == []


@pytest.mark.parametrize("precision", ["16-mixed", 16, "16", "16-true", "transformer-engine-float16"])
def test_validation_flex_refuses_float16(precision):
    with pytest.raises(NotImplementedError, match=r"`dispatcher='flex'` with `precision='16-(mixed|true)'|float16'"):
        _raise(check_flex(OverlapConfig(dispatcher="flex", ep=8), precision=precision))


@pytest.mark.parametrize("precision", ["32-true", 32, "64-true"])
def test_validation_flex_warns_on_full_precision(precision):
    with pytest.warns(UserWarning, match=r"rounded to bfloat16 on every exchange.*`precision='bf16-mixed'`"):
        _raise(check_flex(OverlapConfig(dispatcher="flex", ep=8), precision=precision))


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", "bf16", "transformer-engine", None])
def test_validation_flex_bfloat16_passes(precision, recwarn):
    assert check_flex(OverlapConfig(dispatcher="flex", ep=8), devices_per_node=8, precision=precision) == []
    assert check_flex(OverlapConfig(ep=8), precision="16-mixed") == []  # alltoall carries any dtype


def test_validation_flex_rules_run_in_check_and_at_trainer_construction():
    from lightning.pytorch import Trainer

    from lightning_moe_overlap import MoEOverlapStrategy
    from lightning_moe_overlap.cli import collect_problems

    config = {
        "trainer": {
            "devices": 6,
            "precision": "16-mixed",
            "strategy": {"class_path": "MoEOverlapStrategy", "init_args": {"ep": 6, "dispatcher": "flex"}},
        }
    }
    rules = [p.rule for p in collect_problems(config, machine_checks=False)]
    assert rules.count("flex-ep-size") == 1 and rules.count("flex-precision") == 1
    strategy = MoEOverlapStrategy(ep=2, dispatcher="flex", num_microbatches=2)
    with pytest.warns(UserWarning, match=r"`precision='32-true'`: DeepEP's kernels move bfloat16 only"):
        with pytest.raises(ImportError, match=r"`dispatcher='flex'` \(backend 'deepep'\) needs"):
            Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="32-true", logger=False)
    strategy = MoEOverlapStrategy(ep=3, dispatcher="flex", num_microbatches=2)
    with pytest.raises(ValueError, match=r"`ep=3` \(devices per node=3\)"):
        Trainer(accelerator="cpu", devices=3, strategy=strategy, precision="bf16-mixed", logger=False)


def test_configure_model_builds_on_meta_at_every_pp():
    """Each rank allocates only what it holds, so ``configure_model`` runs under the meta device at every pp."""
    import torch

    from lightning_moe_overlap import MoEOverlapStrategy

    with MoEOverlapStrategy(pp=2, vpp=2, num_microbatches=4).model_sharded_context():
        assert torch.empty(1).device.type == "meta"
    with MoEOverlapStrategy(ep=2).model_sharded_context():
        assert torch.empty(1).device.type == "meta"
