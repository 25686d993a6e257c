"""`check` parses with the parser `fit` uses and reports every problem as a finding, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_moe_overlap.cli import check_main, collect_problems, parse_fit_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"


def _check(capsys, *argv: str) -> tuple[int, str]:
    code = check_main(list(argv))
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    return code, out.out


def test_documented_strategy_keys_parse(capsys):
    code, out = _check(capsys, "--config", str(CONFIGS / "cpu.yaml"), "--trainer.strategy.init_args.checkpoint_format=consolidated")
    assert code == 0 and out.strip().endswith("0 error(s), 0 warning(s)"), out


@pytest.mark.parametrize(
    "override,match",
    [
        ("--trainer.strategy.init_args.bogus=1", r"Option 'bogus' is not accepted"),
        ("--trainer.bogus=1", r"unrecognized arguments: --trainer.bogus=1"),
        ("--model.init_args.bogus=1", r"bogus"),
    ],
)
def test_keys_fit_rejects_are_findings(capsys, override, match):
    code, out = _check(capsys, "--config", str(CONFIGS / "cpu.yaml"), override)
    assert code == 1 and "[config-parse] ValueError: `fit` would reject this config" in out, out
    assert __import__("re").search(match, out), out
    assert out.strip().endswith("1 error(s), 0 warning(s)")


def test_unknown_key_in_a_yaml_file_is_a_finding(capsys, tmp_path):
    extra = tmp_path / "extra.yaml"
    extra.write_text("trainer:\n  strategy:\n    class_path: lightning_moe_overlap.MoEOverlapStrategy\n    init_args:\n      bogus: 1\n")
    code, out = _check(capsys, "--config", str(CONFIGS / "cpu.yaml"), "--config", str(extra))
    assert code == 1 and "[config-parse]" in out and "bogus" in out


def test_gpu_config_on_a_machine_without_cuda(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, out = _check(capsys, "--config", str(CONFIGS / "gpu.yaml"))
    assert code == 1 and "[cuda-unavailable] RuntimeError" in out
    code, out = _check(capsys, "--config", str(CONFIGS / "gpu.yaml"), "--no-machine-checks")
    assert code == 0, out


def test_batch_size_the_microbatches_do_not_split(capsys):
    code, out = _check(capsys, "--config", str(CONFIGS / "cpu.yaml"), "--data.init_args.batch_size=9")
    assert code == 1 and "[batch-size-microbatches] ValueError" in out and "batch_size=9" in out


def test_missing_checkpoint_path(capsys, tmp_path):
    code, out = _check(capsys, "--config", str(CONFIGS / "cpu.yaml"), f"--ckpt_path={tmp_path / 'none.ckpt'}")
    assert code == 1 and "[ckpt-path-exists] FileNotFoundError" in out


def test_registered_strategy_name_and_unknown_devices(capsys):
    code, out = _check(capsys, "--config", str(CONFIGS / "cpu.yaml"), "--trainer.strategy=moe_overlap")
    assert code == 0, out  # the one-liner's defaults: no overlap warning with one micro-batch
    code, out = _check(capsys, "--config", str(CONFIGS / "cpu.yaml"), "--trainer.devices=auto")
    assert code == 1 and "[world-size-unknown]" in out and "--world-size N" in out
    code, out = _check(capsys, "--config", str(CONFIGS / "cpu.yaml"), "--trainer.devices=auto", "--world-size", "4")
    assert code == 0, out


def test_experts_error_suggests_only_ep_values_valid_for_the_world(capsys):
    config, error = parse_fit_config([str(CONFIGS / "cpu.yaml")], ["--trainer.strategy.init_args.ep=3"])
    assert error is None and config is not None
    found = {p.rule: p.message for p in collect_problems(config, 4)}
    assert "ep=3 does not divide dp*cp*tp=4" in found["ep-divides-dp-cp"]
    assert "Choose ep among [1, 2, 4]" in found["experts-divisible-by-ep"]  # 8 experts, 4 processes: not 8


# -- pp > 1: the layout, cut from the meta model as the strategy will cut it ---------------------------------------
PP = str(CONFIGS / "cpu_pp.yaml")


def test_pipeline_config_prints_the_layout_and_each_ranks_parameters(capsys):
    import torch.distributed as dist

    code, out = _check(capsys, "--config", PP, "--world-size", "4")
    assert code == 0 and out.strip().endswith("0 error(s), 0 warning(s)"), out
    lines = out.splitlines()
    assert lines[:5] == [
        "Pipeline: 4 layers in pp * vpp = 2 * 2 = 4 chunks, placement 'interleaved', schedule 'interleaved_1f1b'",
        "  pipeline_layout: 'Et|t|t|tL'",
        "  pp rank 0: chunk 0: Et; chunk 2: t",
        "  pp rank 1: chunk 1: t; chunk 3: tL",
        "Parameters per process (experts: 1/ep of the held chunks' experts, ep=2):",
    ]
    # MoEGPT(vocab 128, hidden 64, 8 experts of ffn 128): a layer's experts 8 * 3 * 64 * 128 = 196,608 and its
    # dense part 17,024; the embedding and the head 8,192 each, the final norm 64
    assert lines[5:7] == [
        "  pp rank 0: 238,848 = dense 42,240 + experts 196,608 (of 393,216); 27.4% of the model's 870,976",
        "  pp rank 1: 238,912 = dense 42,304 + experts 196,608 (of 393,216); 27.4% of the model's 870,976",
    ]
    assert not dist.is_initialized()  # the check path starts no process group


def test_pipeline_config_follows_the_schedules_placement_and_a_layout_string(capsys):
    over = "--trainer.strategy.init_args."
    code, out = _check(capsys, "--config", PP, f"{over}pipeline_schedule=dualpipev")
    assert code == 0 and "  pp rank 0: chunk 0: Et; chunk 3: tL\n  pp rank 1: chunk 1: t; chunk 2: t\n" in out, out
    code, out = _check(capsys, "--config", PP, f"{over}vpp=null", f"{over}pipeline_layout=Ett|t||tL")
    assert code == 0 and "  pp rank 0: chunk 0: Et*2; chunk 2: (empty)\n" in out, out


def test_pipeline_config_on_a_wrong_world_size(capsys):
    code, out = _check(capsys, "--config", PP, "--world-size", "3")
    assert code == 1 and "[world-size] ValueError" in out and "world_size=3" in out, out
    assert out.strip().endswith("1 error(s), 0 warning(s)")


def test_pipeline_layers_that_do_not_split_evenly(capsys):
    code, out = _check(capsys, "--config", PP, "--model.init_args.num_layers=5")
    assert code == 1 and "Pipeline:" not in out, out
    assert "[pipeline-layers] ValueError: `MoEOverlapStrategy`: num_layers=5 does not split evenly into pp * vpp = " \
           "2 * 2 = 4 chunks" in out
    assert "Fix: pass pipeline_layout='Et|t*2|t|tL'" in out
    code, out = _check(capsys, "--config", PP, "--model.init_args.num_layers=5",
                       "--trainer.strategy.init_args.pipeline_layout=Et|t*2|t|tL")
    assert code == 0 and "  pipeline_layout: 'Et|t*2|t|tL'" in out, out  # the suggested layout passes


def test_pipeline_findings_for_models_no_splitter_knows():
    from torch import nn

    from lightning_moe_overlap.cli import pipeline_findings
    from lightning_moe_overlap.config import OverlapConfig
    from lightning_moe_overlap.pipeline.split import PipelineChunks

    class SelfSplitting(nn.Module):
        def configure_pipeline(self, layout):
            return PipelineChunks([nn.Identity()] * layout.num_chunks, nn.functional.mse_loss, lambda b: ((b,), b))

    cfg = OverlapConfig(pp=2, vpp=2, ep=2, num_microbatches=4)
    report, found = pipeline_findings(cfg, nn.Sequential(nn.Linear(2, 2)))
    assert report is None and [(p.rule, p.error) for p in found] == [("pipeline-splitter", TypeError)]
    assert "no built-in splitter knows Sequential" in found[0].message and "configure_pipeline" in found[0].message
    report, found = pipeline_findings(cfg, SelfSplitting())
    assert report is None and "`pipeline_num_layers` attribute" in found[0].message
    model = SelfSplitting()
    model.pipeline_num_layers = 4
    model.fc = nn.Linear(2, 2)  # in no chunk
    report, found = pipeline_findings(cfg, model)
    assert report is None and [(p.rule, p.error) for p in found] == [("pipeline-split", ValueError)]
    assert "2 parameter(s) of the unsplit model are in no chunk" in found[0].message


def test_no_layout_at_pp_1():
    from lightning_moe_overlap.cli import run_checks

    config, error = parse_fit_config([str(CONFIGS / "cpu.yaml")])
    assert error is None and config is not None
    result = run_checks(config)
    assert result.pipeline is None and result.problems == []
    config, _ = parse_fit_config([PP])
    assert run_checks(config).pipeline.startswith("Pipeline: 4 layers")


def _doc_runs(doc: Path) -> list[tuple[list[str], str]]:
    """``(check arguments, printed output)`` of every ``$ lightning-moe-overlap check`` text block of ``doc``."""
    import shlex

    runs = []
    for block in doc.read_text().split("```text\n")[1:]:
        first, _, rest = block.partition("```")[0].partition("\n")
        if first.startswith("$ lightning-moe-overlap check "):
            runs.append((shlex.split(first)[3:], rest))
    return runs


def test_pipeline_doc_shows_the_real_output(capsys, monkeypatch):
    runs = _doc_runs(ROOT / "docs" / "pipeline.md")
    assert len(runs) == 2
    monkeypatch.chdir(ROOT)
    for argv, shown in runs:
        _, out = _check(capsys, *argv)
        assert out == shown, f"docs/pipeline.md is stale for {argv}: paste\n{out}"


def test_expert_balance_rules_are_findings_before_anything_starts(tmp_path):
    callbacks = tmp_path / "balance.yaml"
    callbacks.write_text(
        "trainer:\n  callbacks:\n"
        "    - class_path: lightning_moe_overlap.ExpertBalance\n      init_args: {redundant_experts: 3}\n"
        "    - class_path: lightning_moe_overlap.ExpertBalance\n"
    )
    config, error = parse_fit_config([str(CONFIGS / "cpu.yaml"), str(callbacks)], ["--trainer.strategy.init_args.ep=2",
                                     "--trainer.strategy.init_args.shard=full"])  # fmt: skip
    assert error is None and config is not None
    found = [p for p in collect_problems(config, 4) if p.rule == "expert-balance"]
    messages = "\n".join(p.message for p in found)
    assert "trainer.callbacks[0]: `ExpertBalance`: redundant_experts=3 is not a multiple of ep=2" in messages
    assert "does not run with shard='full'" in messages
    assert "trainer.callbacks[0], trainer.callbacks[1]: 2 `ExpertBalance` callbacks" in messages
    config, _ = parse_fit_config([str(CONFIGS / "cpu.yaml"), str(callbacks)], ["--trainer.strategy.init_args.ep=1"])
    assert any("ep=1 holds every expert on every rank" in p.message for p in collect_problems(config, 4))
