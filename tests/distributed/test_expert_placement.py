"""Expert re-placement during training (``ExpertBalance``) under ``Trainer(strategy=MoEOverlapStrategy(...))``.

Oracle: the same run with the default placement (no callback: the dispatchers route the router's choices as they
are, no slot table). The re-placed run must give bitwise the same loss at every step and bitwise the same
parameters at the end (read as a consolidated, logical state), for this package's ``MoEGPT`` (its aux loss on) and
HF Qwen3-MoE and DeepSeek-V3 (its ``e_score_correction_bias``), with the overlap, shard ``"none"`` and ``"full"``,
at ep=2 (2 ranks) and ep=4 (4 ranks, ``long``). No gradient clipping: the global norm sums each rank's squares
first, and which rank holds an expert changes that order (docs/expert_placement.md). The re-placements must have
moved experts (counted from the reports), or the test would prove nothing.

Checkpoints: a re-placed run checkpointed after a re-placement resumes at another ep (ep=2 -> ep=1) and follows the
unbroken default run bitwise, which it cannot if the checkpoint held experts in their physical slots.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file

from lightning_moe_overlap import ExpertBalance, MoEMonitor, MoEOverlapStrategy, ResumableDataLoader
from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.demo_hf import HFMoECausalLM
from tests.helpers.data import RandomTokens
from tests.helpers.distributed import run_distributed

STEPS, BATCH, MICRO, VOCAB, SEQ = 4, 4, 2, 64, 8


class Tokens(RandomTokens):
    def __init__(self, n: int) -> None:
        super().__init__(n, SEQ, VOCAB, seed=7)


def _build(name: str, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "moegpt":
        return MoEGPT(vocab_size=VOCAB, hidden_size=32, num_layers=layers, num_heads=4, num_experts=8, top_k=2,
                      ffn_hidden_size=16, lr=1e-2)  # fmt: skip
    overrides = {"vocab_size": VOCAB, "num_hidden_layers": 2}
    if name == "deepseek_v3":
        overrides.update(n_routed_experts=8, first_k_dense_replace=0)
    else:
        overrides.update(num_experts=8)
    return HFMoECausalLM(name, lr=1e-2, config_overrides=overrides)


def _fit(name: str, world: int, *, ep: int, shard: str = "none", balance: bool, root: Path | None = None,
         ckpt: Path | None = None, save_every: int = 0, pp: int = 1, vpp: int = 1, schedule: str | None = None,
         micro: int = MICRO, replicas: int = 0, sgd: bool = False, export: Path | None = None) -> dict:  # fmt: skip
    model = _build(name, layers=2 * pp * vpp)
    if sgd:  # a rounding difference stays proportional (Adam divides each element by its own magnitude)
        model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=0.1)
    losses: list[float] = []
    model.on_train_batch_end = lambda outputs, *_: losses.append(float(outputs["loss"]))
    model.train_dataloader = lambda: ResumableDataLoader(Tokens(world * BATCH * STEPS), batch_size=BATCH)
    monitor = MoEMonitor(histogram=False)
    checks = ReplicaCheck()
    balancer = ExpertBalance(every_n_steps=1, min_gain=0.0, redundant_experts=replicas)
    callbacks = [balancer, checks, monitor] if balance else []
    if save_every:
        callbacks.append(ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_train_steps=save_every))
    layout = {"pp": pp, "vpp": vpp, "pipeline_schedule": schedule} if pp > 1 else {}
    strategy = MoEOverlapStrategy(ep=ep, num_microbatches=micro, shard=shard, **layout)
    trainer = Trainer(
        accelerator="cpu", devices=world, max_steps=STEPS, logger=False, enable_checkpointing=bool(save_every),
        log_every_n_steps=1,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=callbacks,
        strategy=strategy,
    )  # fmt: skip
    trainer.fit(model, ckpt_path=ckpt)
    reports = callbacks[0].reports if balance else []
    exported = None
    if export is not None:  # the Hub layout from every rank's share, read back whole on rank 0
        strategy.export_hf(export)
        strategy.barrier()
        exported = load_file(export / "model.safetensors") if trainer.is_global_zero else None
    return {
        "losses": losses,
        "moved": sum(layer.moved_experts for r in reports for layer in r.layers),
        "reports": [[(layer.imbalance_before, layer.imbalance_after) for layer in r.layers] for r in reports],
        "logged": {k: v for k, v in monitor.last.items() if "rank_imbalance" in k or "placement" in k},
        "replica_checks": checks.compared,
        "full": strategy.full_state_dict(),
        "exported": exported,
    }


class ReplicaCheck(Callback):
    """After each step (its optimizer step, refresh and re-placement): every replica row bitwise equal to its
    primary's row, read from the whole parameter (gathered over ep); counts the rows compared."""

    def __init__(self) -> None:
        self.compared = 0

    def on_train_batch_end(self, trainer, pl_module, *_) -> None:
        for module in pl_module.modules():
            slots = getattr(module, "replica_slots", None)
            if slots is None:
                continue
            placement, rank = module.placement, module.dispatcher.ep_rank
            mine = placement.replicas[rank * placement.replicas_per_rank :][: placement.replicas_per_rank]
            for name, param in module.named_parameters(recurse=False):
                whole = param.full_tensor()
                for row, expert in enumerate(mine):
                    assert torch.equal(slots.rows[name][row], whole[placement.slot_of()[expert]]), (name, expert)
                    self.compared += 1


def _compare(results: list[dict], a: object, b: object, *, losses: bool = True) -> None:
    for rank, runs in enumerate(results):
        assert not losses or runs[a]["losses"] == runs[b]["losses"], (rank, a, b)
    state_a, state_b = results[0][a]["full"], results[0][b]["full"]
    assert state_a.keys() == state_b.keys()
    unequal = [k for k in state_a if not torch.equal(state_a[k], state_b[k])]
    assert unequal == [], (a, b, unequal)


def _bitwise_worker(rank: int, world: int, cases: list[tuple[str, str]], root: Path | None = None) -> dict:
    torch.set_num_threads(1)
    out = {}
    for name, shard in cases:
        for balance in (False, True):
            export = root / f"{name}-{shard}-{balance}" if root is not None and name != "moegpt" else None
            out[name, shard, balance] = _fit(name, world, ep=world, shard=shard, balance=balance, export=export)
    return out


def _check_bitwise(results: list[dict], cases: list[tuple[str, str]]) -> None:
    for name, shard in cases:
        assert results[0][name, shard, True]["moved"] > 0, (name, shard)  # the placement did change
        _compare(results, (name, shard, False), (name, shard, True))


def test_replaced_experts_train_bitwise_like_the_default_placement_at_ep2(tmp_path):
    cases = [("moegpt", "none"), ("qwen3_moe", "full")]
    results = run_distributed(_bitwise_worker, 2, cases, tmp_path, timeout_s=600)
    _check_bitwise(results, cases)
    plain, placed = (results[0]["qwen3_moe", "full", balance]["exported"] for balance in (False, True))
    assert plain.keys() == placed.keys() and [k for k in plain if not torch.equal(plain[k], placed[k])] == []
    for rank, runs in enumerate(results):  # every re-placement lowered (or kept) each layer's most loaded rank
        balanced = runs["moegpt", "none", True]
        assert all(after <= before for report in balanced["reports"] for before, after in report), rank
        logged = balanced["logged"]  # MoEMonitor's view of the last step's re-placement, per block
        for block in ("layers.0.mlp", "layers.1.mlp"):
            before, after = balanced["reports"][-1][int(block[7])]
            assert logged[f"moe/{block}/rank_imbalance_before"] == pytest.approx(before), (rank, logged)
            assert logged[f"moe/{block}/rank_imbalance_after"] == pytest.approx(after), (rank, logged)
            # the last step ran under the placement before the last re-placement, whose window is that one step
            assert logged[f"moe/{block}/rank_imbalance"] == pytest.approx(before), (rank, logged)
        assert {"moe/placement/moved_experts", "moe/placement/bytes_sent", "moe/placement/seconds"} <= logged.keys()


@pytest.mark.long
def test_replaced_experts_train_bitwise_at_ep2_and_ep4_every_model_and_shard_mode():
    cases = [(name, shard) for name in ("moegpt", "qwen3_moe", "deepseek_v3") for shard in ("none", "full")]
    for world in (2, 4):
        _check_bitwise(run_distributed(_bitwise_worker, world, cases, timeout_s=1200), cases)


def _pipeline_worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for schedule, vpp, micro, shard in (("1f1b", 1, 2, "none"), ("dualpipev", 2, 4, "full")):
        for balance in (False, True):
            out[schedule, balance] = _fit("moegpt", world, ep=2, pp=2, vpp=vpp, schedule=schedule, micro=micro,
                                          shard=shard, balance=balance)  # fmt: skip
    return out


@pytest.mark.long
def test_replaced_experts_train_bitwise_at_pp2():
    results = run_distributed(_pipeline_worker, 4, timeout_s=1200)
    for schedule in ("1f1b", "dualpipev"):
        assert results[0][schedule, True]["moved"] + results[2][schedule, True]["moved"] > 0, schedule
        _compare(results, (schedule, False), (schedule, True))


def _replica_worker(rank: int, world: int, names: list[str], pp: int = 1) -> dict:
    torch.set_num_threads(1)
    out = {}
    layout = {"pp": pp, "schedule": "1f1b"} if pp > 1 else {}
    for name in names:
        ep = world // pp
        out[name, False] = _fit(name, world, ep=ep, balance=False, sgd=True, **layout)
        out[name, True] = _fit(name, world, ep=ep, balance=True, replicas=ep, sgd=True, **layout)
    return out


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within 1e-6 of the larger magnitude in the tensor (a reordered float32 sum of a few hundred terms)."""
    return bool(((a - b).abs() <= 1e-6 * max(a.abs().max(), b.abs().max(), 1e-30)).all())


def _check_replicas(results: list[dict], names: list[str]) -> None:
    for name in names:
        assert sum(runs[name, True]["replica_checks"] for runs in results) > 0, name  # replicas existed, compared
        for rank, runs in enumerate(results):
            plain, replicated = runs[name, False], runs[name, True]
            ratio = torch.tensor(replicated["losses"]) / torch.tensor(plain["losses"])
            assert ((ratio - 1).abs() <= 1e-6).all(), (name, rank, plain["losses"], replicated["losses"])
        a, b = results[0][name, False]["full"], results[0][name, True]["full"]
        assert a.keys() == b.keys()
        assert [k for k in a if not _close(a[k], b[k])] == [], name


def test_replicas_train_within_rounding_of_the_model_without_them_at_ep2():
    _check_replicas(run_distributed(_replica_worker, 2, ["moegpt"], timeout_s=600), ["moegpt"])


@pytest.mark.long
def test_replicas_train_within_rounding_at_ep4_hf_models_and_pp2():
    names = ["qwen3_moe", "deepseek_v3"]
    _check_replicas(run_distributed(_replica_worker, 4, names, timeout_s=1200), names)
    _check_replicas(run_distributed(_replica_worker, 4, ["moegpt"], 2, timeout_s=1200), ["moegpt"])


def _replica_resume_worker(rank: int, world: int, root: Path) -> dict:
    torch.set_num_threads(1)
    replicated = _fit("moegpt", world, ep=2, balance=True, replicas=2, sgd=True, root=root, save_every=2)
    resumed = _fit("moegpt", world, ep=1, balance=False, sgd=True, ckpt=root / "epoch=0-step=2.ckpt")
    return {"replicated": replicated["losses"][2:], "resumed": resumed["losses"]}


@pytest.mark.long
def test_a_checkpoint_with_replicas_is_logical_and_resumes_without_them_at_ep1(tmp_path):
    for rank, runs in enumerate(run_distributed(_replica_resume_worker, 2, tmp_path, timeout_s=600)):
        ratio = torch.tensor(runs["resumed"]) / torch.tensor(runs["replicated"])
        assert ((ratio - 1).abs() <= 1e-6).all(), (rank, runs)


def _resume_worker(rank: int, world: int, root: Path) -> dict:
    torch.set_num_threads(1)
    out = {"unbroken": _fit("moegpt", world, ep=2, balance=False)}
    _fit("moegpt", world, ep=2, balance=True, root=root / "placed", save_every=2)
    saved = root / "placed" / "epoch=0-step=2.ckpt"
    out["resumed_ep1"] = _fit("moegpt", world, ep=1, balance=False, ckpt=saved)
    out["resumed_ep2"] = _fit("moegpt", world, ep=2, balance=True, ckpt=saved)
    return out


def test_a_checkpoint_after_a_replacement_is_logical_and_resumes_at_another_ep(tmp_path):
    results = run_distributed(_resume_worker, 2, tmp_path, timeout_s=600)
    for rank, runs in enumerate(results):
        unbroken = runs["unbroken"]["losses"][2:]
        assert runs["resumed_ep2"]["losses"] == unbroken, rank  # re-placed again after the resume
        # ep=1 sums each expert's weight gradient over the ranks in another order (all-reduce, not one GEMM):
        # equal to float32 rounding; experts in their physical slots would swap whole experts (an O(1) change)
        assert torch.allclose(torch.tensor(runs["resumed_ep1"]["losses"]), torch.tensor(unbroken), rtol=1e-6)
    _compare(results, "unbroken", "resumed_ep2", losses=False)


@pytest.mark.long
def test_the_benchmark_reports_a_balanced_placement_and_its_move():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import expert_balance

    rows = expert_balance.main(["--ranks", "2", "--experts", "8", "--hot", "2", "--layers", "1", "--seq", "32",
                                "--warmup", "1", "--steps", "1", "--us-per-row", "0", "--a2a-delay-ms", "0",
                                "--repeats", "1"])  # fmt: skip
    balanced = rows["balanced"]
    assert balanced["before"] > 1.25 > balanced["after"] >= 1.0  # both hot experts on rank 0 (4 / 3), then one each
    assert balanced["moved"] >= 2 and balanced["rows"] > 0 and balanced["bytes"] > 0
    assert rows.keys() == {"default", "balanced", "replicas"} and rows["replicas"]["after"] < rows["replicas"]["before"]
