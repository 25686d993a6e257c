"""The printed memory table of ``check`` and its warning against the device's memory.

Columns (bytes of one process of each pp rank, in GiB = 2**30 bytes, or MiB when every total is under 1 GiB): ``params``
(as kept: the shards in the sharded modes), ``gathered`` (the unsharded copies a sharded mode holds during the step),
``grads`` (at the step's peak: unsharded in the gathered parameters), ``optim`` (the optimizer's state on the device),
``activ`` (the activations at the schedule's peak), ``total`` (the device's sum) and ``host`` (the offloaded optimizer
state and activations).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_moe_overlap.cli.memory.estimate import RankMemory

GIB = 1 << 30


def parse_memory_gb(text: str) -> float:
    """``--memory-gb``'s value: a positive number of GiB.

    Raises:
        ValueError: not a positive finite number (the message names the value, the rule and the fix).
    """
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"--memory-gb={text!r} is not a positive number: it is the device memory per process in GiB that the "
            "estimate is compared with. Pass e.g. `--memory-gb 80`, or leave it out to use the current GPU's."
        )
    return value


def device_memory_bytes(memory_gb: float | None) -> tuple[int | None, str]:
    """The device memory to compare with: ``memory_gb`` GiB, else the current CUDA device's total memory when CUDA
    is available, else None; and where it came from."""
    if memory_gb is not None:
        return int(memory_gb * GIB), f"--memory-gb {memory_gb:g}"
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return int(props.total_memory), f"{props.name} total memory"
    return None, "no --memory-gb and no CUDA device"


def _gib(n: int | None, unit: int = GIB) -> str:
    return "?" if n is None else f"{n / unit:.3f}"


def memory_table(rows: Sequence[RankMemory], notes: Sequence[str] = ()) -> str:
    """The table, one line per pp rank, then what the activations count and the notes."""
    head = ("rank", "params", "gathered", "grads", "optim", "activ", "total", "host")
    unit, name = (GIB, "GiB") if any(r.device_total >= GIB for r in rows) else (1 << 20, "MiB")
    lines = [
        (
            f"Memory per process ({name}; the first dp rank of each pp rank; grads at the step's peak, unsharded; "
            "activ at the schedule's peak):"
        ),
        "  " + " ".join(f"{h:>10}" for h in head),
    ]
    for r in rows:
        h = r.held
        cells = (
            f"pp {r.pp_rank}",
            *(
                _gib(n, unit)
                for n in (h.params, h.gathered, h.grads, h.optimizer, r.activations, r.device_total, r.host_total)
            ),
        )
        lines.append("  " + " ".join(f"{c:>10}" for c in cells))
    for r in rows:
        if r.per_microbatch is not None:
            held = ", ".join(f"chunk {c}: {n}" for c, n in sorted(r.in_flight.items()) if n)
            lines.append(f"  pp {r.pp_rank}: one micro-batch's activations {_gib(r.per_microbatch, unit)} {name}; "
                         f"micro-batches held at the peak: {held or 'none'}; grads after the reduction "
                         f"{_gib(r.held.grads_after, unit)} {name}")  # fmt: skip
    lines += [f"  note: {n}" for n in notes]
    return "\n".join(lines)


def memory_warnings(rows: Sequence[RankMemory], limit: int | None, source: str) -> list[str]:
    """One line per pp rank whose device total exceeds ``limit`` bytes (none when ``limit`` is None)."""
    if limit is None:
        return []
    unit, name = (GIB, "GiB") if limit >= GIB else (1 << 20, "MiB")  # the limit's scale: both numbers readable
    return [
        f"warning: pp rank {r.pp_rank} needs about {_gib(r.device_total, unit)} {name} per process, more than the "
        f"{_gib(limit, unit)} {name} of the device ({source}). Shard more (`shard='full'`), raise ep / pp / tp, "
        "recompute or offload activations (SelectiveRecompute, ActivationOffload), or use fewer micro-batches in "
        "flight."
        for r in rows
        if r.device_total > limit
    ]
