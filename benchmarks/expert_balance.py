"""The overlapped step under a skewed router: the default expert placement vs ``ExpertBalance``'s, in one run.

``--ranks`` gloo processes (ep = ranks) train a stack of blocks ``h = x + MLP(x); h + experts(h)`` with
``MoEOverlapStrategy(overlap=True)``. The routing is skewed on purpose: each token's first choice is one of the
``--hot`` first experts and its second one of the others, so the hot experts take half of the assignments; with the
default placement they all sit on ep rank 0. Each expert computation sleeps ``--us-per-row`` microseconds per row
it receives (its backward twice that), so a rank's compute is proportional to its tokens as on a device of its own,
whatever the host's cores; every all-to-all lasts at least ``--a2a-delay-ms`` (a slower network,
``pipelined.DelayedCommunicator``).

Three runs, the same data and steps, in turn for ``--repeats`` rounds in one launch: ``default`` (no callback),
``balanced`` (``ExpertBalance`` re-places once, after ``--warmup`` steps) and ``replicas`` (the same with
``redundant_experts=--replicas``, default one per rank). Printed: the most loaded rank's tokens over the mean
rank's (from the re-placement's counts: under the default placement and under the chosen one), the median
overlapped step time of the steps after the re-placement and its ratio to the default's, and the re-placement
itself (its wall time on the slowest rank, the rows and bytes all ranks sent).

    PYTHONPATH=. python benchmarks/expert_balance.py [--ranks 4] [--experts 16] [--hot 4] [--steps 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipelined import DelayedCommunicator

from lightning_moe_overlap import ExpertBalance, MoEOverlapStrategy
from lightning_moe_overlap.moe.experts import Experts


class Skewed(Dataset):
    """Features ``[S, D]`` and choices ``[S, 2]``: the first among experts ``[0, hot)``, the second among the rest."""

    def __init__(self, n: int, seq: int, hidden: int, experts: int, hot: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, seq, hidden, generator=g)
        first = torch.randint(0, hot, (n, seq, 1), generator=g)
        second = torch.randint(hot, experts, (n, seq, 1), generator=g)
        self.choices = torch.cat([first, second], dim=-1)

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i], self.choices[i]


class _Compute(torch.autograd.Function):
    """Sleeps ``seconds`` forward and twice that backward: the expert compute of a device, without the host's cores."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, seconds: float) -> Tensor:  # type: ignore[override]
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        time.sleep(2 * ctx.seconds)
        return grad, None


class Block(nn.Module):
    def __init__(self, hidden: int, ffn: int, experts: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU())
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = Experts(experts, hidden, ffn)

    def forward(self, x_TD: Tensor, choices_TK: Tensor) -> Tensor:
        h_TD = x_TD + self.mlp(x_TD)
        weights_TK = torch.softmax(self.gate(h_TD).gather(-1, choices_TK), dim=-1)
        return h_TD + self.experts(h_TD, choices_TK, weights_TK)


class SkewedMoE(LightningModule):
    def __init__(self, hidden: int, ffn: int, experts: int, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(hidden, ffn, experts) for _ in range(layers))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x_BSD, choices_BSK = batch
        x_TD, choices_TK = x_BSD.reshape(-1, x_BSD.shape[-1]), choices_BSK.reshape(-1, choices_BSK.shape[-1])
        for block in self.blocks:
            x_TD = block(x_TD, choices_TK)
        return x_TD.pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class Timing(Callback):
    """Per step wall times (each rank), the simulated compute and the simulated network, set at the fit's start."""

    def __init__(self, us_per_row: float, delay_ms: float) -> None:
        self.us_per_row, self.delay_ms = us_per_row, delay_ms
        self.steps: list[float] = []
        self._start = 0.0

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trainer.strategy.runtime.communicator = DelayedCommunicator(self.delay_ms / 1e3)
        for block in pl_module.blocks:
            block.experts.stage("local").register_forward_pre_hook(self._compute)

    def _compute(self, module: nn.Module, args: tuple) -> tuple:
        x_RD, *rest = args
        return (_Compute.apply(x_RD, x_RD.shape[0] * self.us_per_row / 1e6), *rest)

    def on_train_batch_start(self, trainer: Trainer, *_: Any) -> None:
        dist.barrier()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, *_: Any) -> None:
        self.steps.append(time.perf_counter() - self._start)


def _fit(rank: int, world: int, args: argparse.Namespace, balanced: bool, replicas: int) -> dict:
    model = SkewedMoE(args.hidden, args.ffn, args.experts, args.layers)
    timing = Timing(args.us_per_row, args.a2a_delay_ms)
    balance = ExpertBalance(every_n_steps=args.warmup, min_gain=0.0, redundant_experts=replicas)
    steps = args.warmup + args.steps
    trainer = Trainer(
        accelerator="cpu", devices=world, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
        callbacks=[timing, balance] if balanced else [timing],
        strategy=MoEOverlapStrategy(ep=world, num_microbatches=args.microbatches, overlap=True),
    )  # fmt: skip
    data = Skewed(world * args.batch * steps, args.seq, args.hidden, args.experts, args.hot)
    trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=args.batch))
    out: dict[str, Any] = {"step_s": statistics.median(timing.steps[args.warmup :])}
    if balanced:
        report = balance.reports[0]
        move = torch.tensor([report.move.seconds, report.move.rows_sent, report.move.bytes_sent], dtype=torch.float64)
        total = move.clone()
        dist.all_reduce(total)
        dist.all_reduce(move[:1], op=dist.ReduceOp.MAX)
        out.update(
            before=statistics.mean(layer.imbalance_before for layer in report.layers),
            after=statistics.mean(layer.imbalance_after for layer in report.layers),
            moved=sum(layer.moved_experts for layer in report.layers),
            seconds=float(move[0]), rows=int(total[1]), bytes=int(total[2]),
        )  # fmt: skip
    return out


def _worker(rank: int, world: int, args: argparse.Namespace, replicas: int) -> dict:
    """Every variant in turn, ``--repeats`` rounds (A B C A B C ...): drift affects them alike; medians per variant."""
    torch.set_num_threads(1)
    variants = {"default": (False, 0), "balanced": (True, 0), "replicas": (True, replicas)}
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, (balanced, extra) in variants.items():
            runs[name].append(_fit(rank, world, args, balanced, extra))
    return {
        name: {**found[-1], "step_s": statistics.median(r["step_s"] for r in found)} for name, found in runs.items()
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--hot", type=int, default=4, help="experts taking half of the assignments")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3, help="steps counted before the one re-placement")
    parser.add_argument("--steps", type=int, default=8, help="steps measured after it")
    parser.add_argument("--us-per-row", type=float, default=20.0, help="simulated expert compute per row")
    parser.add_argument("--a2a-delay-ms", type=float, default=2.0)
    parser.add_argument("--replicas", type=int, default=None, help="replica slots per layer (default: --ranks)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of the three runs (medians reported)")
    args = parser.parse_args(argv)
    replicas = args.ranks if args.replicas is None else args.replicas
    from tests.helpers.distributed import run_distributed

    rows = run_distributed(_worker, args.ranks, args, replicas, timeout_s=3600)[0]
    default = rows["default"]
    print(f"{args.ranks} ranks (ep={args.ranks}), {args.experts} experts, top-2 with the first choice among "
          f"{args.hot} hot experts; {args.layers} layers, {args.microbatches} micro-batches of "
          f"{args.batch * args.seq // args.microbatches} tokens, overlap on; {args.us_per_row:g} us per expert row, "
          f"all-to-all >= {args.a2a_delay_ms:g} ms; {replicas} replicas per layer in the last row")  # fmt: skip
    print(f"{'placement':<10} {'max rank / mean':>16} {'step (s)':>9} {'step / default':>15}")
    print(f"{'default':<10} {rows['balanced']['before']:>16.2f} {default['step_s']:>9.3f} {1.0:>15.2f}")
    for name in ("balanced", "replicas"):
        row = rows[name]
        print(f"{name:<10} {row['after']:>16.2f} {row['step_s']:>9.3f} {row['step_s'] / default['step_s']:>15.2f}")
    for name in ("balanced", "replicas"):
        row = rows[name]
        print(
            f"re-placement ({name}): {row['moved']} experts moved over {args.layers} layers, {row['rows']} rows, "
            f"{row['bytes'] / 2**20:.2f} MiB sent by all ranks, {1e3 * row['seconds']:.1f} ms (slowest rank)"
        )
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
