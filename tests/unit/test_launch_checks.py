"""Checks made before spawning, warnings once on rank 0, and defaults that do not warn."""

from __future__ import annotations

import warnings

import pytest
from lightning.pytorch import LightningDataModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.config import OverlapConfig, resolve_overlap
from lightning_moe_overlap.demo import SyntheticTokens
from lightning_moe_overlap.validation import (
    SAME_ON_EVERY_RANK,
    check_launch,
    check_machine,
    check_config,
    known_batch_size,
    raise_problems,
)


class _Attr(LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 6


def test_batch_size_is_read_where_the_datamodule_says_it():
    assert known_batch_size(SyntheticTokens(batch_size=10)) == 10  # a hyper-parameter / attribute
    assert known_batch_size(_Attr()) == 6
    assert known_batch_size(LightningDataModule()) is None
    assert known_batch_size(None) is None


def test_batch_size_not_split_by_microbatches_fails_before_spawning():
    problems = check_launch(OverlapConfig(num_microbatches=4), known_batch_size(SyntheticTokens(batch_size=6)))
    with pytest.raises(ValueError, match=r"batch_size=6 does not split into `num_microbatches=4`.*among \[2, 3, 6\]"):
        raise_problems(problems)
    assert check_launch(OverlapConfig(num_microbatches=3), 6) == []


def test_missing_checkpoint_path_fails_before_spawning(tmp_path):
    missing = tmp_path / "nope.ckpt"
    with pytest.raises(FileNotFoundError, match=r"`ckpt_path='.*nope.ckpt'` does not exist.*pass `ckpt_path=None`"):
        raise_problems(check_launch(OverlapConfig(), None, str(missing)))
    (tmp_path / "ok.ckpt").write_bytes(b"")
    assert check_launch(OverlapConfig(), None, str(tmp_path / "ok.ckpt")) == []
    assert check_launch(OverlapConfig(), None, "last") == []


def test_fit_raises_the_prespawn_error_once_in_the_launching_process(tmp_path):
    from lightning_moe_overlap.demo import MoEGPT

    trainer = Trainer(accelerator="cpu", devices=2, strategy=MoEOverlapStrategy(ep=2, num_microbatches=4), logger=False)
    model = MoEGPT(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_experts=4, ffn_hidden_size=16)
    with pytest.raises(ValueError, match=r"batch_size=6 does not split"):  # no process was started
        trainer.fit(model, datamodule=SyntheticTokens(vocab_size=32, seq_len=8, batch_size=6))
    trainer = Trainer(accelerator="cpu", devices=2, strategy=MoEOverlapStrategy(ep=2, num_microbatches=2), logger=False)
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        trainer.fit(model, datamodule=SyntheticTokens(vocab_size=32, seq_len=8), ckpt_path=str(tmp_path / "x"))
    assert not trainer.strategy.launcher.procs


def test_gpu_accelerator_without_cuda_is_a_machine_problem():
    with pytest.raises(RuntimeError, match=r"the accelerator is 'gpu' but this machine has no CUDA device"):
        raise_problems(check_machine(OverlapConfig(), "cuda", cuda_available=False))
    assert check_machine(OverlapConfig(), "cuda", cuda_available=True) == []


def test_raised_validation_errors_are_marked_same_on_every_rank():
    with pytest.raises(ValueError) as info:
        raise_problems(check_config(OverlapConfig(ep=0)))
    assert getattr(info.value, SAME_ON_EVERY_RANK) is True


def test_validation_warnings_show_on_rank_zero_only(monkeypatch):
    problems = check_config(OverlapConfig(overlap=True, num_microbatches=1))
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        raise_problems(problems)  # silent on rank 1
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    with pytest.warns(UserWarning, match=r"`overlap=True` with `num_microbatches=1`"):
        raise_problems(problems)


def test_overlap_default_follows_the_number_of_microbatches():
    assert resolve_overlap(None, 1) is False and resolve_overlap(None, 4) is True
    assert resolve_overlap(True, 1) is True and resolve_overlap(False, 4) is False
    assert MoEOverlapStrategy(num_microbatches=2).config.overlap is True


def test_documented_one_liner_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer = Trainer(accelerator="cpu", devices=2, strategy="moe_overlap", logger=False)
    assert trainer.strategy.config.overlap is False


def test_overlap_at_ep1_warns_only_when_the_user_set_it():
    """Left unset, `overlap` follows the micro-batches (on here) and says nothing; set to True, the warning is
    actionable (set ep > 1) and shown."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        unset = Trainer(accelerator="cpu", devices=2, strategy=MoEOverlapStrategy(num_microbatches=2), logger=False)
    assert unset.strategy.config.overlap is True and unset.strategy.config.overlap_requested is None
    with pytest.warns(UserWarning, match=r"`overlap=True` with `ep=1`: no all-to-all crosses processes.*Set `ep>1`"):
        Trainer(accelerator="cpu", devices=2, strategy=MoEOverlapStrategy(overlap=True, num_microbatches=2), logger=False)


def test_experts_not_divisible_by_ep_fail_before_spawning_with_valid_suggestions():
    from lightning_moe_overlap.demo import MoEGPT

    trainer = Trainer(accelerator="cpu", devices=4, strategy=MoEOverlapStrategy(ep=4, num_microbatches=2), logger=False)
    model = MoEGPT(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_experts=6, ffn_hidden_size=16)
    # 6 experts on 4 processes: ep must divide 6 and dp*cp=4, so only [1, 2] (not [1, 2, 3, 6])
    with pytest.raises(ValueError, match=r"num_experts=6, which ep=4 does not divide.*Choose ep among \[1, 2\]"):
        trainer.fit(model, datamodule=SyntheticTokens(vocab_size=32, seq_len=8, batch_size=4))
    assert not trainer.strategy.launcher.procs


def test_trainer_settings_fail_before_spawning():
    from lightning_moe_overlap.demo import MoEGPT

    trainer = Trainer(
        accelerator="cpu", devices=2, accumulate_grad_batches=2, logger=False,
        strategy=MoEOverlapStrategy(ep=2, num_microbatches=2),
    )
    model = MoEGPT(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_experts=4, ffn_hidden_size=16)
    model.automatic_optimization = False  # refused before any process starts (accumulation is supported)
    with pytest.raises(NotImplementedError, match=r"manual optimization .* is not supported"):
        trainer.fit(model, datamodule=SyntheticTokens(vocab_size=32, seq_len=8, batch_size=4))
    assert not trainer.strategy.launcher.procs
