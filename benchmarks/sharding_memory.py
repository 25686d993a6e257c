"""Per-rank bytes of parameters, gradients and optimizer state for each ``shard`` mode, measured next to the formula.

Trains this package's MoE GPT (AdamW) one step under ``MoEOverlapStrategy(ep=..., shard=mode)`` on gloo ranks and,
after the optimizer step, sums the storage each rank actually holds (distinct storages, padding included, local
shards of DTensors) for:

- ``params``: what the module holds and what the optimizer holds (the same tensors unless ``shard="optimizer"``,
  where the module holds the gathered parameters and the optimizer their shards);
- ``grads``: the ``.grad`` of both;
- ``optim``: every tensor of the optimizer's state (AdamW: ``exp_avg``, ``exp_avg_sq``, ``step``).

The formula, from the unsharded model's shapes with ``D`` the dense and ``X`` this rank's expert bytes
(``X = experts / ep``), ``dp`` the data-parallel size (x cp) and ``edp = dp / ep``:

    none:      params D + X               grads D + X              optim 2 (D + X)
    optimizer: params D + X + D/dp + X/edp grads D/dp + X/edp       optim 2 (D/dp + X/edp)
    full:      params D/dp + X/edp         grads D/dp + X/edp       optim 2 (D/dp + X/edp)

(``optimizer`` keeps the gathered compute copy and the optimizer's shard.) The AdamW ``step`` scalars are in the
measurement, not in the formula.

With ``--pp 2`` (interleaved, two chunks per rank) ``D`` and ``X`` are those of the chunks the rank holds (its
stage's share: the first stage holds the embedding, the last the head) and ``dp = ranks / pp``: each stage's
chunks are sharded over its own dp ranks.

Usage: ``python benchmarks/sharding_memory.py [--ranks 4] [--ep 2] [--pp 1] [--vocab 2048] [--hidden 128]
[--layers 4] [--experts 8] [--ffn 256] [--json]``
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

MODES = ("none", "optimizer", "full")


@dataclass(frozen=True)
class Shape:
    vocab: int = 2048
    hidden: int = 128
    layers: int = 4
    experts: int = 8
    ffn: int = 256


@dataclass
class Row:
    mode: str
    params: int
    grads: int
    optim: int
    formula_params: int
    formula_grads: int
    formula_optim: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optim

    @property
    def formula_total(self) -> int:
        return self.formula_params + self.formula_grads + self.formula_optim


def build_model(shape: Shape):
    from lightning_moe_overlap.demo import MoEGPT

    return MoEGPT(vocab_size=shape.vocab, hidden_size=shape.hidden, num_layers=shape.layers, num_heads=4,
                  num_experts=shape.experts, top_k=2, ffn_hidden_size=shape.ffn, aux_loss_coeff=0.0)  # fmt: skip


def model_bytes(shape: Shape) -> tuple[int, int]:
    """(dense, expert) bytes of the unsharded model."""
    return held_model_bytes(build_model(shape))


def held_model_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(dense, expert) bytes of the parameters of ``model`` this rank holds, at their unsharded (global) shapes:
    the whole model at ``pp = 1``, the rank's chunks at ``pp > 1`` (the others are on meta)."""
    sizes = [(".experts." in n, p.numel() * p.element_size()) for n, p in model.named_parameters() if not p.is_meta]
    expert = sum(size for is_expert, size in sizes if is_expert)
    return sum(size for _, size in sizes) - expert, expert


def formula(mode: str, dense: int, expert: int, *, ep: int, dp: int) -> tuple[int, int, int]:
    """(params, grads, optim) bytes per rank of ``mode`` (module docstring); AdamW keeps two states per element."""
    full = dense + expert // ep
    shard = dense // dp + expert // ep // (dp // ep)
    if mode == "none":
        return full, full, 2 * full
    if mode == "optimizer":
        return full + shard, shard, 2 * shard
    return shard, shard, 2 * shard


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def held_bytes(tensors: list[Tensor], seen: set[int]) -> int:
    """Bytes of the distinct storages behind ``tensors`` not already in ``seen`` (updated)."""
    total = 0
    for t in tensors:
        storage = _local(t).untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def measure(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int, int]:
    """(params, grads, optim) bytes this rank holds: distinct storages of the module's and the optimizer's
    parameters, their gradients, and the optimizer's state tensors."""
    owned = [p for group in optimizer.param_groups for p in group["params"] if not p.is_meta]
    params = [*(p for p in model.parameters() if not p.is_meta), *owned]
    grads = [p.grad for p in params if p.grad is not None]
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor)]
    seen: set[int] = set()
    return held_bytes(params, seen), held_bytes(grads, seen), held_bytes(state, seen)


def run_mode(
    mode: str, shape: Shape, *, ranks: int, ep: int, pp: int = 1
) -> tuple[tuple[int, int, int], tuple[int, int]]:
    """Train one step in ``mode`` (inside an initialised process group of ``ranks`` ranks): this rank's bytes, and
    the (dense, expert) bytes of what it holds at unsharded shapes (:func:`held_model_bytes`)."""
    from lightning.pytorch import Callback, Trainer
    from torch.utils.data import DataLoader

    from lightning_moe_overlap import MoEOverlapStrategy

    measured: list[tuple[int, int, int]] = []

    class Measure(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:  # noqa: ANN001, ANN002
            measured.append(measure(pl_module, trainer.optimizers[0]))

    model = build_model(shape)
    tokens = torch.randint(0, shape.vocab, (4 * ranks, 16), generator=torch.Generator().manual_seed(0))
    model.train_dataloader = lambda: DataLoader(tokens, batch_size=2 * pp)
    layout = {"pp": pp, "vpp": 2, "num_microbatches": 2 * pp} if pp > 1 else {"num_microbatches": 2}
    trainer = Trainer(
        accelerator="cpu", devices=ranks, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Measure()], limit_val_batches=0,
        strategy=MoEOverlapStrategy(ep=ep, shard=mode, **layout),
    )  # fmt: skip
    trainer.fit(model)
    return measured[-1], held_model_bytes(model)


def worker(rank: int, world: int, shape: Shape, ep: int, pp: int = 1) -> list[Row]:
    rows = []
    for mode in MODES:
        got, (dense, expert) = run_mode(mode, shape, ranks=world, ep=ep, pp=pp)
        rows.append(Row(mode, *got, *formula(mode, dense, expert, ep=ep, dp=world // pp)))
    return rows


def table(rows: list[Row]) -> str:
    mib = 1 << 20
    lines = [
        "| shard | params MiB | grads MiB | optimizer MiB | total MiB | formula MiB | measured / formula |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| `{r.mode}` | {r.params / mib:.2f} | {r.grads / mib:.2f} | {r.optim / mib:.2f} | {r.total / mib:.2f} "
            f"| {r.formula_total / mib:.2f} | {r.total / r.formula_total:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[list[Row]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    for name, default in asdict(Shape()).items():
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    shape = Shape(**{k: getattr(args, k) for k in asdict(Shape())})
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.helpers.distributed import run_distributed

    per_rank = run_distributed(worker, args.ranks, shape, args.ep, args.pp, timeout_s=300)
    dense, expert = model_bytes(shape)
    if args.json:
        print(json.dumps([[asdict(r) for r in rows] for rows in per_rank]))
    else:
        print(f"MoE GPT {shape}: dense {dense / 2**20:.2f} MiB, experts {expert / 2**20:.2f} MiB (all ranks), "
              f"{args.ranks} ranks, ep={args.ep}, pp={args.pp}; per rank:")  # fmt: skip
        for rank, rows in enumerate(per_rank):
            print(f"rank {rank}:")
            print(table(rows))
    return per_rank


if __name__ == "__main__":
    main()
