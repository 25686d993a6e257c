"""A supervised fine-tune's loss does not depend on how a batch is split (Hugging Face Qwen3-MoE, SGD, 2 gloo ranks).

The samples label a different number of tokens each (``-100`` on a "prompt" of varying length), and one labels
none. The built-in module divides each micro-batch's token sum by the step's count (``step_tokens``), so at
``num_microbatches`` = 1, 2 and 4, with ``accumulate_grad_batches=2``, at ``ep=2`` and at ``pp=2``, every logged loss
and every parameter equal transformers' own loss of each rank's whole batch in one process (``model(**batch).loss``,
its gradient averaged over the dp ranks as the strategy averages), within the bound of the float32 sums a split step
may reorder (``tests/helpers/tolerance.py``: ``decoder_chain``, about 9e-5 relative for the loss; the old mean of
micro-batch means is 4e-3 off); with ``token_mean_over_dp`` the loss of the global batch. Before, a micro-batch
without labels made every logged loss NaN.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo_hf import HFMoECausalLM
from lightning_moe_overlap.parallel.dtensors import local
from tests.helpers.distributed import run_distributed
from tests.helpers.tolerance import assert_within, decoder_chain, reordered_sum_tol, trained_param_tol

LR, STEPS, SEQ, VOCAB, SAMPLES = 0.5, 2, 8, 128, 16
# the sums a split, expert-parallel or pipelined step may order otherwise than one process (the tiny Qwen3-MoE of
# HFMoECausalLM: 2 layers, hidden 32, 4 heads of 8, 8 experts of 16, top-2), over at most 8 samples of SEQ - 1 targets
TOKENS = 8 * (SEQ - 1)
CHAIN = decoder_chain(layers=2, hidden=32, heads=4, head_dim=8, ffn=16, experts=8, top_k=2, vocab=VOCAB, seq=SEQ,
                      tokens=TOKENS)  # fmt: skip
LOSS_RTOL = reordered_sum_tol(CHAIN, 1.0)  # about 9e-5: the worst case of that chain, relative to the loss


class SFTSamples(Dataset):
    """Sample ``i``: random token ids, labels ``-100`` on its first ``1 + i % 6`` positions; sample 0 labels none."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict:
        labels = self.ids[i].clone()
        labels[: SEQ if i == 0 else 1 + i % 6] = -100
        return {"input_ids": self.ids[i], "labels": labels, "attention_mask": torch.ones(SEQ, dtype=torch.long)}


class SGDHF(HFMoECausalLM):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


class Logged(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def fit(strategy_args: dict, *, batch_size: int, accumulate: int = 1) -> dict:
    seed_everything(0)
    model = SGDHF()
    logged = Logged()
    strategy = MoEOverlapStrategy(timeout=120, **strategy_args)
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, accumulate_grad_batches=accumulate,
        limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[logged],
    )  # fmt: skip
    data = SFTSamples()
    dp = strategy.dims.dp
    sampler = DistributedSampler(data, num_replicas=dp, rank=dist.get_rank() % dp, shuffle=False)
    trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=batch_size, sampler=sampler))
    params = {n: local(p).detach().clone() for n, p in model.named_parameters() if not p.is_meta}
    return {"losses": logged.losses, "params": params}


EP_RUNS = {  # name: (strategy arguments, batch size, accumulate)
    "m1": (dict(ep=2, num_microbatches=1), 4, 1),
    "m2": (dict(ep=2, num_microbatches=2), 4, 1),
    "m4": (dict(ep=2, num_microbatches=4), 4, 1),
    "m2-acc2": (dict(ep=2, num_microbatches=2), 2, 2),
    "dp-m4": (dict(ep=2, num_microbatches=4, token_mean_over_dp=True), 4, 1),
}
PP_RUNS = {
    "pp-m2": (dict(pp=2, pipeline_schedule="1f1b", num_microbatches=2), 4, 1),
    "pp-m4": (dict(pp=2, pipeline_schedule="1f1b", num_microbatches=4), 4, 1),
    "pp-m2-acc2": (dict(pp=2, pipeline_schedule="1f1b", num_microbatches=2), 2, 2),
}


def worker(rank: int, world_size: int, runs: dict) -> dict:
    torch.use_deterministic_algorithms(True)
    return {name: fit(args, batch_size=size, accumulate=acc) for name, (args, size, acc) in runs.items()}


def one_process(dp: int, *, over_dp: bool) -> dict:
    """transformers' own loss of each dp rank's batch of 4 (rank r: samples r, r + dp, ...), SGD on the dp mean of
    their gradients (``over_dp``: on the loss of the global batch); the losses per rank and step."""
    torch.manual_seed(0)
    model = SGDHF()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = SFTSamples()
    losses: list[list[float]] = [[] for _ in range(dp)]
    halves: list[list[float]] = [[] for _ in range(dp)]  # each half batch's own loss (accumulate_grad_batches=2)
    for step in range(STEPS):
        batches = []
        for r in range(dp):
            rows = [data[r + dp * (4 * step + j)] for j in range(4)]
            batches.append({k: torch.stack([row[k] for row in rows]) for k in rows[0]})
            with torch.no_grad():
                parts = [{k: v[h * 2 : h * 2 + 2] for k, v in batches[r].items()} for h in (0, 1)]
                halves[r] += [_own_loss(model.model, part) for part in parts]
        if over_dp:
            whole = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
            loss = model.model(**whole).loss
            for r in range(dp):
                losses[r].append(loss.item())
        else:
            each = [model.model(**b).loss for b in batches]
            for r in range(dp):
                losses[r].append(each[r].item())
            loss = sum(each) / dp
        opt.zero_grad()
        loss.backward()
        opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "halves": halves, "params": params, "init": init}


def _own_loss(model: torch.nn.Module, batch: dict) -> float:
    """transformers' loss of ``batch``; 0 for a batch without labels (the strategy logs 0 there, not HF's NaN)."""
    return float(model(**batch).loss) if (batch["labels"][:, 1:] != -100).any() else 0.0


def check(run: dict, want: dict, rank: int, name: str, experts_of: int) -> None:
    assert all(torch.isfinite(torch.tensor(run["losses"]))), (rank, name, run["losses"])
    check_losses(run["losses"], want["losses"][rank], f"rank {rank} {name}")
    assert run["params"], (rank, name)
    for param, got in run["params"].items():
        full, init = want["params"][param], want["init"][param]
        if got.shape != full.shape:  # experts: this rank's half of the global [E, ...]
            full, init = full.chunk(2)[experts_of], init.chunk(2)[experts_of]
        assert_within(got, full, trained_param_tol(CHAIN, TOKENS, init=init, want=full), f"{rank} {name} {param}")


def check_losses(got: list[float], want: list[float], msg: str) -> None:
    want_t = torch.tensor(want, dtype=torch.float64)
    assert_within(torch.tensor(got), want_t, LOSS_RTOL * want_t.abs(), msg)


def test_sft_loss_is_the_per_token_mean_at_every_split_with_ep() -> None:
    ranks = run_distributed(worker, 2, EP_RUNS, timeout_s=300)
    per_rank, global_ = one_process(2, over_dp=False), one_process(2, over_dp=True)
    for rank, runs in enumerate(ranks):
        for name, run in runs.items():
            want = global_ if name.startswith("dp-") else per_rank
            # accumulated: one logged loss per batch of 2 (2 per step), the others one per step of 4
            if name.endswith("acc2"):
                continue
            check(run, want, rank, name, experts_of=rank)
        acc = runs["m2-acc2"]  # each batch of 2 logs its own per-token mean; the step's gradient is the window's
        check_losses(acc["losses"], per_rank["halves"][rank], f"rank {rank} m2-acc2")
        for param, got in acc["params"].items():
            want, init = runs["m1"]["params"][param], per_rank["init"][param]
            if init.shape != want.shape:
                init = init.chunk(2)[rank]
            assert_within(got, want, trained_param_tol(CHAIN, TOKENS, init=init, want=want), f"{rank} acc2 {param}")


@pytest.mark.parametrize("runs", [PP_RUNS])
def test_sft_loss_is_the_per_token_mean_at_every_split_with_pp(runs: dict) -> None:
    ranks = run_distributed(worker, 2, runs, timeout_s=300)
    want = one_process(1, over_dp=False)
    for rank, by_name in enumerate(ranks):
        for name, run in by_name.items():
            if name.endswith("acc2"):  # each batch of 2 logs its own per-token mean; the parameters the window's
                check_losses(run["losses"], want["halves"][0], f"rank {rank} {name}")
                run = {"losses": want["losses"][0], "params": run["params"]}
            check(run, want, 0, f"{name} (rank {rank})", experts_of=0)
