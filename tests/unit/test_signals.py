"""``SignalAgreement`` in one process: the handler records and forwards, runs no collective; the agreement at a
batch boundary raises Lightning's ``SIGTERMException`` and marks the trainer; nothing before it is installed. The
2-process behaviour (a signal during a save's collectives) is ``tests/distributed/test_sigterm.py``."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_moe_overlap.processes.signals import SignalAgreement


class Launcher:
    def __init__(self) -> None:
        self.killed: list[int] = []

    def kill(self, signum: int) -> None:
        self.killed.append(signum)


@pytest.fixture
def trainer():
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    before = signal.getsignal(signal.SIGTERM)
    trainer._signal_connector.register_signal_handlers()  # what Trainer.fit does before the loops run
    yield trainer
    trainer._signal_connector.teardown()
    signal.signal(signal.SIGTERM, before)


def test_the_handler_records_and_forwards_once_and_the_agreement_stops(trainer, monkeypatch) -> None:
    launcher = Launcher()
    monkeypatch.setattr(type(trainer.strategy), "launcher", property(lambda self: launcher))
    agreement = SignalAgreement()
    agreement.agree(torch.device("cpu"))  # not installed: nothing
    agreement.install(trainer)
    assert agreement.installed
    agreement.agree(torch.device("cpu"))  # no signal: nothing
    handler = signal.getsignal(signal.SIGTERM)
    handler(signal.SIGTERM, None)
    handler(signal.SIGTERM, None)
    assert agreement.received and launcher.killed == [signal.SIGTERM]  # forwarded once
    assert not trainer.received_sigterm  # Lightning's flag waits for the agreement
    with pytest.raises(SIGTERMException) as raised:
        agreement.agree(torch.device("cpu"))
    assert trainer.received_sigterm and raised.value.code == 143  # a preempted run's status, not a finished one's
    agreement.uninstall()
    assert not agreement.installed and not agreement.received


def test_a_handler_that_is_not_lightnings_is_left_alone() -> None:
    before = signal.getsignal(signal.SIGTERM)
    agreement = SignalAgreement()
    agreement.install(SimpleNamespace(_signal_connector=SimpleNamespace(_sigterm_notifier_fn=print)))
    assert not agreement.installed and signal.getsignal(signal.SIGTERM) is before
