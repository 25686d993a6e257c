"""Loading a published checkpoint into the sharded model, and exporting it back: each rank's peak host memory, bytes
read and written, and times.

Writes a Qwen3-MoE model with many experts in the Hub's layout (``save_pretrained``: per-expert keys, sharded
safetensors + index) into ``--dir``, then starts ``--ranks`` gloo processes that each run
``Trainer.fit(HFMoECausalLM(pretrained=DIR), max_steps=0)`` under ``MoEOverlapStrategy(ep=RANKS, shard=...)``: the
model is built on the meta device, made expert-parallel and sharded, then every rank reads its part of the files
(``parallelize/steps.py``, ``apply_pretrained``). Per rank:

- **peak host memory above the baseline**: the process's peak resident set (``VmHWM``) is reset
  (``/proc/self/clear_refs``) when ``configure_model`` is about to run and read once the strategy is set up; the
  baseline is the resident set at the reset (interpreter, torch, the process group);
- **bytes read**: the bytes of the file boxes this rank's reads cover (the loader's count; the files are
  memory-mapped, so the kernel's I/O counters would show page-cache hits as nothing);
- **its share**: the bytes of the tensors it holds after setup (local shards), and the **load time** (the loader's
  own wall time, and setup as a whole).

With ``--export``, each rank then writes the model back to the Hub's layout (``MoEOverlapStrategy.export_hf``: no
rank gathers the model), the peak reset just before; the folder is checked bitwise against the one it loaded (no
step ran). ``--pp 2`` cuts the model into 2 stages (vpp 2; ep = ranks / pp).

Next to them: the model's full size, and ``from_pretrained`` of the whole model in one process (time and peak), so
the table shows three ratios: peak / (share + largest file), bytes read / share, and load time on the ranks /
``from_pretrained`` time. Host memory is Linux's accounting (``/proc``); other systems are refused.

Usage: ``python benchmarks/hf_load.py [--ranks 4] [--pp 1] [--experts 64] [--layers 8] [--hidden 512] [--ffn 512]
[--vocab 4096] [--shard full] [--max-shard-size 200MB] [--export] [--dir DIR] [--json]``
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

SELF = Path("/proc/self")


@dataclass(frozen=True)
class Shape:
    experts: int = 64
    layers: int = 8
    hidden: int = 512
    ffn: int = 512
    vocab: int = 4096


@dataclass
class RankRow:
    rank: int
    baseline_mib: float
    peak_mib: float  # above the baseline
    held_mib: float  # the rank's share: bytes of the tensors it holds
    read_mib: float
    load_s: float
    setup_s: float
    export_peak_mib: float = 0.0  # above the resident set when the export starts
    written_mib: float = 0.0
    export_s: float = 0.0


def rss_kib(field: str) -> int:
    for line in (SELF / "status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> int:
    """Reset the peak resident set to the current one; returns it (KiB)."""
    (SELF / "clear_refs").write_text("5")
    return rss_kib("VmRSS")


def config(shape: Shape) -> dict:
    return dict(
        hidden_size=shape.hidden, intermediate_size=shape.ffn, moe_intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers, num_attention_heads=8, num_key_value_heads=4, head_dim=shape.hidden // 8,
        num_experts=shape.experts, num_experts_per_tok=2, vocab_size=shape.vocab, tie_word_embeddings=False,
    )  # fmt: skip


def write_checkpoint(shape: Shape, folder: Path, max_shard_size: str) -> tuple[int, int]:
    """The model in the Hub's layout; returns (its bytes, the largest file's bytes)."""
    from lightning_moe_overlap.demo_hf import build_hf_model

    torch.manual_seed(0)
    model = build_hf_model("qwen3_moe", **config(shape))
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    size = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    return size, max(f.stat().st_size for f in folder.glob("*.safetensors"))


def from_pretrained_whole(folder: Path) -> tuple[float, float]:
    """``from_pretrained`` of the whole model in this process: (seconds, peak MiB above the baseline)."""
    from transformers import AutoModelForCausalLM

    baseline = reset_peak()
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder)
    seconds = time.perf_counter() - started
    peak = rss_kib("VmHWM") - baseline
    del model
    return seconds, peak / 1024


def held_bytes(module: torch.nn.Module) -> int:
    """Bytes of the distinct storages the module's tensors hold here (local shards; meta tensors hold none)."""
    from sharding_memory import held_bytes as storage_bytes  # benchmarks/, on the path of a script run from there

    from lightning_moe_overlap.parallel.dtensors import local

    tensors = [t for t in module.state_dict(keep_vars=True).values() if not local(t).is_meta]
    return storage_bytes(tensors, set())


def worker(rank: int, world: int, folder: str, shard: str, pp: int, export: str | None) -> RankRow:
    from lightning.pytorch import Callback, Trainer

    from lightning_moe_overlap import MoEOverlapStrategy
    from lightning_moe_overlap.demo_hf import HFMoECausalLM

    torch.set_num_threads(1)
    marks: dict[str, float] = {}

    class Measure(Callback):
        def setup(self, trainer, pl_module, stage) -> None:  # noqa: ANN001 - before configure_model
            marks["baseline"] = reset_peak()
            marks["start"] = time.perf_counter()

        def on_fit_start(self, trainer, pl_module) -> None:  # noqa: ANN001 - the strategy is set up
            marks["setup_s"] = time.perf_counter() - marks["start"]
            marks["peak"] = rss_kib("VmHWM") - marks["baseline"]
            marks["held"] = held_bytes(pl_module)

    model = HFMoECausalLM(pretrained=folder)
    layout = {"pp": pp, "vpp": 2, "num_microbatches": pp * 2} if pp > 1 else {"num_microbatches": 1}
    strategy = MoEOverlapStrategy(ep=world // pp, shard=shard, **layout)
    trainer = Trainer(
        accelerator="cpu", devices=world, max_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Measure()], strategy=strategy,
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=[torch.zeros(1, 4, dtype=torch.long)])
    report = strategy.loaded_weights
    assert report is not None
    mib = 1 << 20
    row = RankRow(
        rank, marks["baseline"] / 1024, marks["peak"] / 1024, marks["held"] / mib, report.bytes_read / mib,
        report.seconds, marks["setup_s"],
    )
    if export is None:
        return row
    baseline = reset_peak()
    written = strategy.export_hf(export, max_shard_bytes=Path(folder).joinpath(".max_shard").read_text())
    row.export_peak_mib = (rss_kib("VmHWM") - baseline) / 1024
    row.written_mib, row.export_s = written.bytes_written / mib, written.seconds
    return row


def same_tensors(a: Path, b: Path) -> bool:
    """Whether two Hub folders hold the same keys with bitwise equal tensors (one tensor at a time)."""
    from safetensors import safe_open

    def where(folder: Path) -> dict[str, Path]:
        found = {}
        for file in folder.glob("*.safetensors"):
            with safe_open(str(file), framework="pt") as f:
                found.update(dict.fromkeys(f.keys(), file))
        return found

    left, right = where(a), where(b)
    if left.keys() != right.keys():
        return False
    for key in left:
        with safe_open(str(left[key]), framework="pt") as f, safe_open(str(right[key]), framework="pt") as g:
            if not torch.equal(f.get_tensor(key), g.get_tensor(key)):
                return False
    return True


def table(rows: list[RankRow], full_mib: float, file_mib: float, whole: tuple[float, float]) -> str:
    lines = [
        "| rank | share MiB | peak above baseline MiB | peak / (share + largest file) | read MiB | read / share "
        "| load s | setup s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.rank} | {r.held_mib:.1f} | {r.peak_mib:.1f} | {r.peak_mib / (r.held_mib + file_mib):.2f} "
            f"| {r.read_mib:.1f} | {r.read_mib / r.held_mib:.2f} | {r.load_s:.2f} | {r.setup_s:.2f} |"
        )
    slowest = max(r.load_s for r in rows)
    if any(r.export_s for r in rows):
        lines += ["", "| rank | share MiB | export peak above its start MiB | (share + export peak) / (1.25 share + "
                  "largest file) | written MiB | export s |", "|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        lines += [
            f"| {r.rank} | {r.held_mib:.1f} | {r.export_peak_mib:.1f} | "
            f"{(r.held_mib + r.export_peak_mib) / (1.25 * r.held_mib + file_mib):.2f} | {r.written_mib:.1f} "
            f"| {r.export_s:.2f} |"
            for r in rows
        ]
    lines.append("")
    lines.append(
        f"Model {full_mib:.1f} MiB (fp32), largest file {file_mib:.1f} MiB; `from_pretrained` of the whole model in "
        f"one process: {whole[0]:.2f} s, peak {whole[1]:.1f} MiB above its baseline. Load on {len(rows)} ranks "
        f"(slowest rank) / `from_pretrained`: {slowest / whole[0]:.2f}; full model / rank 0's share: "
        f"{full_mib / rows[0].held_mib:.2f}."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (vpp 2; ep = ranks / pp)")
    parser.add_argument("--export", action="store_true", help="then export it back (strategy.export_hf) and measure")
    for name, default in asdict(Shape()).items():
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--shard", default="full", choices=["none", "optimizer", "full"])
    parser.add_argument("--max-shard-size", default="200MB")
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary folder)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not (SELF / "clear_refs").exists():
        raise SystemExit("benchmarks/hf_load.py measures host memory through Linux's /proc; run it on Linux.")
    shape = Shape(**{k: getattr(args, k) for k in asdict(Shape())})
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.helpers.distributed import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.dir) if args.dir else Path(tmp) / "checkpoint"
        full, largest = write_checkpoint(shape, folder, args.max_shard_size)
        (folder / ".max_shard").write_text(args.max_shard_size)
        whole = from_pretrained_whole(folder)
        exported = Path(tmp) / "exported" if args.export else None
        rows = run_distributed(worker, args.ranks, str(folder), args.shard, args.pp, exported and str(exported),
                               timeout_s=1200)  # fmt: skip
        same = None if exported is None else same_tensors(folder, exported)
    mib = 1 << 20
    result = {"shape": asdict(shape), "ranks": args.ranks, "pp": args.pp, "shard": args.shard, "full_mib": full / mib,
              "export_equal": same,
              "largest_file_mib": largest / mib, "from_pretrained_s": whole[0], "from_pretrained_peak_mib": whole[1],
              "rows": [asdict(r) for r in rows]}  # fmt: skip
    if args.json:
        print(json.dumps(result))
    else:
        print(f"Qwen3-MoE {shape}, {args.ranks} ranks, pp={args.pp}, ep={args.ranks // args.pp}, shard={args.shard!r}:")
        print(table(rows, full / mib, largest / mib, whole))
        if same is not None:
            print(f"Exported folder bitwise equal to the loaded one: {same}.")
    return result


if __name__ == "__main__":
    main()
