"""A training job whose rank ``--rank`` misbehaves at step 2, for tests/distributed/test_rank_exits.py.

    python rank_exits_job.py <mode> <rank> <pid_dir> <devices> <timeout_s>

Modes: ``hang`` (sleeps in ``training_step``, ignoring SIGTERM), ``sigkill`` (kills itself with SIGKILL), ``raise``
(raises ValueError in ``on_train_batch_end``, outside the micro-batch schedule), ``raise-in-step`` (the demo MoE model
at ep=2 raises ValueError in ``training_step`` at the first step: the other rank stops inside the overlapped schedule,
its parameters gathered mid-step; with rank -1 every rank raises it, with -2 every rank its own), ``wait`` (every rank
sleeps in ``training_step``, for a test that kills the launching process), ``late-config`` (the model builds, in
``configure_model``, experts that ep=2 does not divide: an error every rank finds after spawning). Each rank writes its
pid to ``<pid_dir>/rank<r>.pid`` before it starts training.
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_moe_overlap import MoEOverlapStrategy  # noqa: E402
from lightning_moe_overlap.demo import MoEGPT, SyntheticTokens  # noqa: E402
from lightning_moe_overlap.moe import MoELayer  # noqa: E402
from tests.helpers.models import DenseRegressor  # noqa: E402

MODE, BAD_RANK, PID_DIR, DEVICES, TIMEOUT = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])


class Misbehaving(DenseRegressor):
    def on_train_start(self):
        (PID_DIR / f"rank{self.global_rank}.pid").write_text(str(os.getpid()))
        if MODE in ("hang", "wait"):  # training_step runs in the schedule's thread; signals are set up here
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def configure_model(self):
        if MODE == "late-config" and not hasattr(self, "moe"):
            self.moe = MoELayer(hidden_size=8, ffn_hidden_size=8, num_experts=3, top_k=1)

    def training_step(self, batch, batch_idx):
        if batch_idx == 2 and (MODE == "wait" or self.global_rank == BAD_RANK):
            if MODE in ("hang", "wait"):
                time.sleep(600)
            if MODE == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        super().on_train_batch_end(outputs, batch, batch_idx)
        if MODE == "raise" and batch_idx == 2 and self.global_rank == BAD_RANK:
            raise ValueError("boom outside the schedule")


class RaisingGPT(MoEGPT):
    def on_train_start(self):
        (PID_DIR / f"rank{self.global_rank}.pid").write_text(str(os.getpid()))

    def training_step(self, batch, batch_idx):
        if self.global_rank == BAD_RANK or BAD_RANK == -1:
            raise ValueError("boom inside the step")
        if BAD_RANK == -2:
            raise ValueError(f"boom inside the step on rank {self.global_rank}")
        return super().training_step(batch, batch_idx)


def _raise_in_step() -> None:
    trainer = Trainer(
        accelerator="cpu", devices=DEVICES, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, default_root_dir=str(PID_DIR),
        strategy=MoEOverlapStrategy(ep=2, num_microbatches=2, timeout=TIMEOUT),
    )
    model = RaisingGPT(vocab_size=64, hidden_size=32, num_experts=4, ffn_hidden_size=32)
    trainer.fit(model, datamodule=SyntheticTokens(vocab_size=64, seq_len=16, batch_size=4))


if __name__ == "__main__" and MODE == "raise-in-step":
    torch.set_num_threads(1)
    _raise_in_step()
elif __name__ == "__main__":
    torch.set_num_threads(1)
    trainer = Trainer(
        accelerator="cpu", devices=DEVICES, max_steps=6, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(PID_DIR),
        strategy=MoEOverlapStrategy(ep=2 if MODE == "late-config" else 1, timeout=TIMEOUT),
    )
    trainer.fit(Misbehaving())
