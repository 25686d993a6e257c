"""Our MoE layer against torchtitan's at the same shape: step times side by side, as ratios per round.

Launches ``--ranks`` gloo processes on CPU (expert parallel over all of them) and trains the model of
``overlap.py`` (``x + MoE(x + MLP(x))`` blocks, same defaults) five ways in the same run, and times their
communication alone two ways; one step of each mode per round, modes interleaved so that drift affects all alike:

- ``ours_seq``: our :class:`MoELayer` with the engine, sequential, ``--microbatches`` micro-batches;
- ``ours_overlap``: the same, overlapped (forward of micro-batch ``i+1`` paired with the backward of ``i``);
- ``tt_accum``: torchtitan's ``MoE`` with its own expert parallelism (``AllToAllTokenDispatcher``,
  ``spmd_backend="partial_dtensor"``), the same micro-batches by gradient accumulation;
- ``ours_full``: ours, the whole batch in one call (one micro-batch of ``tokens * microbatches`` tokens);
- ``tt_full``: torchtitan, the whole batch in one call;
- ``comm_micro`` / ``comm_full``: the collectives of a step alone, no compute, at either schedule
  (:func:`comm_step`): the communication floor both models share. The sequential ratios are also printed net of it.

Both models start from the same weights (torchtitan's experts are copied from ours: ``w1``/``w3`` are the gate and
up halves of ``gate_up_proj``, ``w2`` is ``down_proj``) and see the same data; dense layers, loss, gradient
synchronisation (:func:`sync_gradients`) and SGD are shared code. The first step's losses are compared: they agree
to about 1e-7 relative in every precision mode, so they show the two models compute the same function, not which
precision ran.

torchtitan 0.3.0 is an optional dependency (``pip install 'lightning-moe-overlap[peer]'``); without it the script
exits with the install hint. Usage: ``python benchmarks/peer_torchtitan.py [--rounds 5] [--warmup 2] [--json]``
plus the shape options of ``overlap.py`` (``--help``). Precision: by default torchtitan's expert GEMMs run in
bfloat16 (its ``GroupedExperts`` casts to it) and ours in float32; ``--autocast`` runs both under bfloat16 autocast,
``--float32`` runs torchtitan's experts in float32 (:func:`float32_experts`: its own forward without the casts), so
that both sides compute in float32 (the fair comparison on a CPU without bfloat16 instructions; the results then
agree to about 1e-8, not bitwise). See ``docs/benchmarks.md`` for the figures and caveats.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from overlap import Config, Net, align, build_trainer, busy_warning, make_batch, spawn_ranks, train_step

from lightning_moe_overlap.parallel.grads import sync_gradients
from lightning_moe_overlap.moe.dispatch.comm import all_to_all_raw, exchange_counts
from lightning_moe_overlap.overlap.observers import CommTraffic
from lightning_moe_overlap.overlap.runtime import CommRuntime
from lightning_moe_overlap.parallel import ParallelDims, ParallelGroups, build_mesh

TORCHTITAN_VERSION = "0.3.0"
INSTALL_HINT = (
    f"pip install 'lightning-moe-overlap[peer]' (or: pip install torchtitan=={TORCHTITAN_VERSION} --no-deps "
    "spmd_types==0.2.3 tyro einops triton)"
)
MODEL_MODES = ("ours_seq", "ours_overlap", "tt_accum", "ours_full", "tt_full")
COMM_MODES = {"comm_micro": "micro", "comm_full": "full"}  # the collectives alone, per schedule (`comm_step`)
MODES = (*MODEL_MODES, *COMM_MODES)
BASELINE = "ours_seq"
# The ratios docs/benchmarks.md reports:
PAIRS = (("tt_full", "ours_full"), ("tt_accum", "ours_seq"), ("ours_overlap", "tt_full"))
# The same ratios net of the communication floor both sides share (sequential schedules only: the overlap hides
# part of its communication, so subtracting all of it would not be a floor):
PRECISIONS = {  # what each side's GEMMs run in
    "default": "torchtitan's experts bfloat16, the rest float32",
    "autocast": "all bfloat16 (autocast)",
    "float32": "all float32",
}
NET_PAIRS = (("tt_full", "ours_full", "comm_full"), ("tt_accum", "ours_seq", "comm_micro"))


def check_torchtitan() -> str | None:
    """``None`` when torchtitan's MoE imports, else a message with the install hint."""
    try:
        import torchtitan  # noqa: F401
        from torchtitan.models.common import moe  # noqa: F401
    except ImportError as e:
        return (
            f"peer_torchtitan.py needs torchtitan {TORCHTITAN_VERSION} and its MoE imports ({e}); install it: "
            f"{INSTALL_HINT}"
        )
    version = importlib.metadata.version("torchtitan")
    if version != TORCHTITAN_VERSION:
        print(f"warning: torchtitan {version} installed, the script was written for {TORCHTITAN_VERSION}",
              file=sys.stderr)
    return None


# -- torchtitan's MoE with our weights -------------------------------------------------------------------------------
class TitanMoE(nn.Module):
    """torchtitan's ``MoE`` behind our layer's ``[T, D] -> [T, D]`` call (it wants ``[B, L, D]``)."""

    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self.moe = moe

    def forward(self, x_TD: Tensor) -> Tensor:
        return self.moe(x_TD.unsqueeze(0)).view_as(x_TD)


def titan_moe(cfg: Config, ours: nn.Module) -> nn.Module:
    """A torchtitan ``MoE`` with the weights of our unsharded :class:`MoELayer` ``ours`` (same routing math)."""
    from torchtitan.models.common.config_utils import make_moe_config, make_router_config, make_routed_experts_config
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config
    import spmd_types as spmd

    no_init: dict[str, Callable[[Tensor], None]] = {"weight": lambda p: None}
    config = make_moe_config(
        num_experts=cfg.experts,
        router=make_router_config(
            dim=cfg.hidden, num_experts=cfg.experts, gate_param_init=no_init, top_k=cfg.top_k,
            score_func="softmax", route_norm=True,  # = ours: top-k of the softmax, renormalised
        ),
        routed_experts=make_routed_experts_config(
            dim=cfg.hidden, hidden_dim=cfg.ffn, num_experts=cfg.experts, top_k=cfg.top_k,
            param_init={n: (lambda p: None) for n in ("w1_EFD", "w2_EDF", "w3_EFD")}, comm_backend="standard",
        ),
        load_balance_coeff=None,  # no expert bias: ours has none either
    )
    set_moe_sharding_config(
        config, enable_ep=cfg.ep_size > 1, enable_sp=False,
        expert_param_layout={"w1_EFD": spmd.S(1), "w2_EDF": spmd.S(2), "w3_EFD": spmd.S(1)},
    )
    moe = config.build()
    gate_up, down = ours.experts.gate_up_proj.detach(), ours.experts.down_proj.detach()
    with torch.no_grad():
        moe.router.gate.weight.copy_(ours.gate.weight)
        inner = moe.routed_experts.inner_experts
        inner.w1_EFD.copy_(gate_up[:, : cfg.ffn])
        inner.w3_EFD.copy_(gate_up[:, cfg.ffn :])
        inner.w2_EDF.copy_(down)
    return moe


def float32_experts(inner: nn.Module) -> None:
    """Make torchtitan's ``GroupedExperts`` module ``inner`` compute in float32: its forward (torchtitan 0.3.0,
    ``models/common/moe.py``) without the casts to bfloat16 (the partial-DTensor backend's path)."""
    from torch.distributed.tensor import DTensor

    def forward(x_RD: Tensor, num_tokens_per_expert_E: Tensor) -> Tensor:
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (inner.w1_EFD, inner.w2_EDF, inner.w3_EFD))
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        h_RF = nn.functional.silu(inner._grouped_mm(A=x_RD, B_t=w1.transpose(-2, -1), offs=offsets_E))
        h_RF = h_RF * inner._grouped_mm(A=x_RD, B_t=w3.transpose(-2, -1), offs=offsets_E)
        return inner._grouped_mm(A=h_RF, B_t=w2.transpose(-2, -1), offs=offsets_E).type_as(x_RD)

    inner.forward = forward


def titan_dims(cfg: Config) -> Any:
    """torchtitan's ``ParallelDims`` for ep over all ranks (the rest data parallel), partial-DTensor backend."""
    from torchtitan.distributed import ParallelDims as TitanDims
    from torchtitan.distributed.utils import set_spmd_backend

    set_spmd_backend("partial_dtensor")
    # torchtitan picks "cuda" when no accelerator is found; its mesh must live on the CPU here.
    for name in ("torchtitan.tools.utils", "torchtitan.distributed.parallel_dims"):
        sys.modules[name].device_type = "cpu"
    dims = TitanDims(
        dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=cfg.ep_size, world_size=cfg.ranks,
        spmd_backend="partial_dtensor",
    )
    dims.build_mesh()
    return dims


@dataclass
class TitanTrainer:
    """torchtitan's MoE in our block stack, trained by plain gradient accumulation."""

    net: Net
    optimizer: torch.optim.Optimizer
    dense: list[nn.Parameter]
    expert: list[nn.Parameter]


def build_titan(cfg: Config, dims: Any, float32: bool = False) -> TitanTrainer:
    net = Net(cfg)  # same seed, same dense weights and routers as ours
    for block in net.blocks:
        moe = titan_moe(cfg, block.moe)
        if cfg.ep_size > 1:
            moe.parallelize(dims)
        if float32:
            float32_experts(moe.routed_experts.inner_experts)
        block.moe = TitanMoE(moe)
    expert_ids = {id(p) for block in net.blocks for p in block.moe.moe.routed_experts.parameters()}
    params = list(net.parameters())
    return TitanTrainer(
        net=net,
        optimizer=torch.optim.SGD(params, lr=1e-3),
        dense=[p for p in params if id(p) not in expert_ids],
        expert=[p for p in params if id(p) in expert_ids],
    )


def accumulation_step(t: Any, cfg: Config, groups: ParallelGroups, batch: tuple[Tensor, Tensor]) -> dict:
    """One optimizer step with gradient accumulation over ``cfg.microbatches`` micro-batches, in this thread.

    ``t``: a :class:`TitanTrainer`, or one of ours (its engine unused: profiling ours on the main thread).
    """
    x, y = batch
    m = cfg.microbatches
    cpu_start = time.process_time()
    start = time.perf_counter()
    t.optimizer.zero_grad(set_to_none=False)
    losses = []
    for i in range(m):
        loss = nn.functional.mse_loss(t.net(x[i]), y[i])
        (loss / m).backward()
        losses.append(loss.detach())
    sync_gradients(t.dense, t.expert, dp_cp_group=groups.dp_cp, edp_group=groups.edp,
                   dp_cp_size=dist.get_world_size(groups.dp_cp))
    t.optimizer.step()
    end = time.perf_counter()
    return {"step_s": end - start, "cpu_s": time.process_time() - cpu_start, "loss": float(torch.stack(losses).mean())}


# -- the collectives alone ------------------------------------------------------------------------------------------
@dataclass
class CommFloor:
    """The collectives of one step of ``cfg`` without its compute, through our comm path (`comm_step`)."""

    cfg: Config
    groups: ParallelGroups
    runtime: CommRuntime
    traffic: CommTraffic  # attached to `runtime`
    counts: Tensor  # [experts] int64: the token-count exchange
    rows: Tensor  # [tokens * top_k, hidden] float32: the rows of one dispatch
    dense: list[nn.Parameter]  # zeros shaped like the model's parameters, for the gradient synchronisation
    expert: list[nn.Parameter]


def comm_floor(cfg: Config, groups: ParallelGroups, dense: list[nn.Parameter], expert: list[nn.Parameter]) -> CommFloor:
    """What :func:`comm_step` sends for the model of ``cfg`` whose parameters are ``dense`` and ``expert``."""
    def zeros(params: list[nn.Parameter]) -> list[nn.Parameter]:
        return [nn.Parameter(torch.zeros_like(p)) for p in params]

    runtime, traffic = CommRuntime(), CommTraffic()
    runtime.attach(traffic)
    g = torch.Generator().manual_seed(cfg.seed)
    rows = torch.randn(cfg.tokens * cfg.top_k, cfg.hidden, generator=g)
    counts = torch.zeros(cfg.experts, dtype=torch.long)
    return CommFloor(cfg, groups, runtime, traffic, counts, rows, zeros(dense), zeros(expert))


def even_splits(rows: int, ranks: int) -> list[int]:
    """``rows`` split over ``ranks`` as evenly as integers allow (the first ones one row more)."""
    return [rows // ranks + (r < rows % ranks) for r in range(ranks)]


def comm_step(floor: CommFloor) -> dict[str, float]:
    """One step's collectives with no compute: the communication floor both models share at this schedule.

    Per micro-batch, block by block as the all-to-all dispatcher issues them: forward the token-count exchange,
    the dispatch and the combine; backward, blocks in reverse, the combine's gradient and the dispatch's. Then the
    gradient synchronisation, as :func:`train_step`. Every data all-to-all carries ``tokens * top_k`` float32 rows
    from each rank, the rows of a dropless top-k dispatch, split evenly over the ep ranks (the models' routing
    splits them unevenly, which only lengthens the slowest transfer: a floor, not a replay). A dropless
    all-to-all MoE issues no fewer collectives at this schedule; torchtitan issues the same (240 all-to-alls per
    step at the default shape).
    """
    cfg, groups, runtime = floor.cfg, floor.groups, floor.runtime
    ep = groups.ep
    ranks, me = dist.get_world_size(ep), dist.get_rank(ep)
    send = even_splits(floor.rows.shape[0], ranks)  # rows to each rank
    recv = [send[me]] * ranks  # every rank sends this rank its share
    counts = floor.counts.view(ranks, -1)
    cpu_start = time.process_time()
    start = time.perf_counter()
    for _ in range(cfg.microbatches):
        for _ in range(cfg.layers):  # forward
            exchange_counts(counts, ep, runtime)
            received = all_to_all_raw(floor.rows, recv, send, ep, runtime)
            all_to_all_raw(received, send, recv, ep, runtime)
        for _ in range(cfg.layers):  # backward: the combine's gradient out, the dispatch's gradient back
            received = all_to_all_raw(floor.rows, recv, send, ep, runtime)
            all_to_all_raw(received, send, recv, ep, runtime)
    sync_gradients(floor.dense, floor.expert, dp_cp_group=groups.dp_cp, edp_group=groups.edp,
                   dp_cp_size=dist.get_world_size(groups.dp_cp))
    end = time.perf_counter()
    return {"step_s": end - start, "cpu_s": time.process_time() - cpu_start}


# -- one rank --------------------------------------------------------------------------------------------------------
def rank_main(
    rank: int, cfg: Config, rounds: int, warmup: int, profile: tuple[str, ...] = (), precision: str = "default"
) -> dict[str, Any]:
    device = torch.device("cpu")
    groups = build_mesh(ParallelDims.from_world_size(cfg.ranks, ep=cfg.ep_size), "cpu").process_groups(rank)
    full = replace(cfg, tokens=cfg.tokens * cfg.microbatches, microbatches=1)
    x, y = make_batch(cfg, rank, device)
    batch = {"micro": (x, y), "full": (x.reshape(1, -1, cfg.hidden), y.reshape(1, -1, cfg.hidden))}
    dims = titan_dims(cfg)
    ours = {
        "ours_seq": (build_trainer(cfg, "sequential", groups, device), cfg, "micro"),
        "ours_overlap": (build_trainer(cfg, "overlap", groups, device), cfg, "micro"),
        "ours_full": (build_trainer(full, "sequential", groups, device), full, "full"),
    }
    f32 = precision == "float32"
    titan = {
        "tt_accum": (build_titan(cfg, dims, f32), cfg, "micro"),
        "tt_full": (build_titan(full, dims, f32), full, "full"),
    }
    model = ours["ours_seq"][0]
    floors = {mode: comm_floor({"micro": cfg, "full": full}[which], groups, model.dense, model.expert)
              for mode, which in COMM_MODES.items()}
    records: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}  # (wall, CPU) seconds per step
    first_loss: dict[str, float] = {}

    def run(mode: str, step: int, plain: bool = False) -> tuple[float, float]:
        # --autocast: the whole step under bfloat16 autocast, both models alike (the engine's lanes inherit it)
        autocast = precision == "autocast"
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            return run_step(mode, step, plain)

    def run_step(mode: str, step: int, plain: bool) -> tuple[float, float]:
        if mode in floors:
            record = comm_step(floors[mode])
        elif mode in ours and plain:
            trainer, c, which = ours[mode]
            record = accumulation_step(trainer, c, groups, batch[which])
        elif mode in ours:
            trainer, c, which = ours[mode]
            if step == 0:
                first_loss[mode] = first_step_loss(trainer.net, c, batch[which])
            record = train_step(trainer, c, groups, batch[which])
        else:
            trainer, c, which = titan[mode]
            record = accumulation_step(trainer, c, groups, batch[which])
            if step == 0:
                first_loss[mode] = record["loss"]
        return record["step_s"], record["cpu_s"]

    for step in range(warmup + rounds):
        for mode in MODES:
            align(device)
            times = run(mode, step)
            if step >= warmup:
                records[mode].append(times)
    tables = {}
    for mode in profile:  # after the measured rounds: the profiler's overhead stays out of them
        align(device)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run(mode, -1, plain=True)  # ours without the engine: its lanes are threads the profiler misses
        tables[mode] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=36)
    return {"records": records, "first_loss": first_loss, "profiles": tables}


def first_step_loss(net: nn.Module, cfg: Config, batch: tuple[Tensor, Tensor]) -> float:
    """Mean micro-batch loss before any update (no gradient)."""
    x, y = batch
    with torch.no_grad():
        return float(torch.stack([nn.functional.mse_loss(net(x[i]), y[i]) for i in range(cfg.microbatches)]).mean())


def rank_entry(
    rank: int, cfg: Config, rounds: int, warmup: int, profile: tuple[str, ...], precision: str, port: int, queue: Any
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(cfg.threads)
    # torchtitan's router asks for float32 autocast, which CPU autocast does not support (a no-op there).
    warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=cfg.ranks, timeout=timedelta(seconds=600))
        queue.put((rank, True, rank_main(rank, cfg, rounds, warmup, profile, precision)))
    except BaseException:  # noqa: BLE001 - reported by the launcher
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(
    cfg: Config, rounds: int, warmup: int, profile: tuple[str, ...] = (), precision: str = "default"
) -> list[dict[str, Any]]:
    """Spawn one process per rank and collect their results (index = rank)."""
    return spawn_ranks(cfg.ranks, rank_entry, cfg, rounds, warmup, profile, precision)


# -- summary ---------------------------------------------------------------------------------------------------------
def summarise(results: list[dict[str, Any]], cfg: Config, rounds: int, precision: str = "default") -> dict[str, Any]:
    """Per round the slowest rank's step; per mode the median step and the median of its per-round ratios."""
    steps = {mode: [max(r["records"][mode][i][0] for r in results) for i in range(rounds)] for mode in MODES}
    cpu = {mode: [statistics.fmean(r["records"][mode][i][1] for r in results) for i in range(rounds)] for mode in MODES}

    def ratio(a: str, b: str, times: dict[str, list[float]] = steps) -> dict[str, Any]:
        per_round = [x / y for x, y in zip(times[a], times[b])]
        return {"median": statistics.median(per_round), "min": min(per_round), "max": max(per_round)}

    def net_ratio(a: str, b: str, floor: str, times: dict[str, list[float]] = steps) -> dict[str, Any]:
        per_round = [(x - f) / (y - f) for x, y, f in zip(times[a], times[b], times[floor])]
        return {"median": statistics.median(per_round), "min": min(per_round), "max": max(per_round)}

    losses = {mode: statistics.fmean(r["first_loss"][mode] for r in results) for mode in MODEL_MODES}
    return {
        "config": asdict(cfg),
        "rounds": rounds,
        "precision": PRECISIONS[precision],
        "torch": torch.__version__,
        "torchtitan": importlib.metadata.version("torchtitan"),
        "modes": {
            mode: {
                "step_s": statistics.median(steps[mode]),
                "steps_s": steps[mode],
                "ratio": ratio(mode, BASELINE),
                "cpu_s": statistics.median(cpu[mode]),
                "cpu_ratio": ratio(mode, BASELINE, cpu),
            }
            for mode in MODES
        },
        **{f"{a}/{b}": ratio(a, b) for a, b in PAIRS},
        **{f"{a}/{b} cpu": ratio(a, b, cpu) for a, b in PAIRS},
        **{f"{a}/{b} net of {f}": net_ratio(a, b, f) for a, b, f in NET_PAIRS},
        **{f"{a}/{b} net of {f} cpu": net_ratio(a, b, f, cpu) for a, b, f in NET_PAIRS},
        "first_loss": losses,
        "loss_rel_diff": {
            "tt_accum vs ours_seq": abs(losses["tt_accum"] / losses["ours_seq"] - 1),
            "tt_full vs ours_full": abs(losses["tt_full"] / losses["ours_full"] - 1),
            "ours_full vs ours_seq": abs(losses["ours_full"] / losses["ours_seq"] - 1),
        },
    }


def print_summary(s: dict[str, Any]) -> None:
    cfg = s["config"]
    print(
        f"ranks={cfg['ranks']} ep={cfg['ep'] or cfg['ranks']} layers={cfg['layers']} hidden={cfg['hidden']} "
        f"ffn={cfg['ffn']} experts={cfg['experts']} top_k={cfg['top_k']} tokens={cfg['tokens']} "
        f"microbatches={cfg['microbatches']} precision: {s['precision']}; torch={s['torch']} "
        f"torchtitan={s['torchtitan']}; "
        f"medians of {s['rounds']} interleaved rounds"
    )
    print(f"{'mode':<14} {'step ms':>8} {'ratio':>6} {'CPU ms':>8} {'CPU ratio':>9}")
    for mode, v in s["modes"].items():
        print(f"{mode:<14} {1e3 * v['step_s']:8.1f} {v['ratio']['median']:6.3f} {1e3 * v['cpu_s']:8.1f} "
              f"{v['cpu_ratio']['median']:9.3f}")
    for a, b in PAIRS:
        r, c = s[f"{a}/{b}"], s[f"{a}/{b} cpu"]
        print(f"{a}/{b:<12} step median {r['median']:.3f} (rounds {r['min']:.3f}-{r['max']:.3f}); "
              f"CPU time median {c['median']:.3f}")
    for a, b, f in NET_PAIRS:
        r, c = s[f"{a}/{b} net of {f}"], s[f"{a}/{b} net of {f} cpu"]
        print(f"{a}/{b} net of {f}: step median {r['median']:.3f} (rounds {r['min']:.3f}-{r['max']:.3f}); "
              f"CPU time median {c['median']:.3f}")
    print("first-step loss: " + ", ".join(f"{m} {v:.6f}" for m, v in s["first_loss"].items()))
    print("loss relative difference: " + ", ".join(f"{k} {v:.1e}" for k, v in s["loss_rel_diff"].items()))


def parse_args(argv: list[str] | None = None) -> tuple[Config, int, int, tuple[str, ...], bool, str]:
    defaults = Config()
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    for name in ("ranks", "layers", "hidden", "ffn", "dense_ffn", "experts", "top_k", "tokens", "microbatches",
                 "threads", "seed"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    parser.add_argument("--ep", type=int, default=None, help="expert-parallel size (None: --ranks)")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (one step of every mode each)")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured rounds first")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument(
        "--autocast", action="store_true",
        help="run every step under torch.autocast('cpu', bfloat16), both models alike: all GEMMs in bfloat16 "
        "(without it torchtitan's expert GEMMs still run in bfloat16, ours in float32)",
    )
    parser.add_argument(
        "--float32", action="store_true",
        help="torchtitan's expert GEMMs in float32 (its forward without the casts to bfloat16), as ours: the same "
        "precision on both sides",
    )
    parser.add_argument(
        "--profile", nargs="*", default=[], choices=MODEL_MODES, metavar="MODE",
        help=f"after the rounds, profile one step of each MODE ({', '.join(MODEL_MODES)}) and print rank 0's top "
        "ops",
    )
    args = vars(parser.parse_args(argv))
    rounds, warmup, as_json, autocast = args.pop("rounds"), args.pop("warmup"), args.pop("json"), args.pop("autocast")
    float32 = args.pop("float32")
    if autocast and float32:
        parser.error("--autocast and --float32 ask for two precisions; pick one")
    profile = tuple(args.pop("profile"))
    precision = "autocast" if autocast else "float32" if float32 else "default"
    return Config(**args), rounds, warmup, profile, as_json, precision


def main(argv: list[str] | None = None) -> None:
    cfg, rounds, warmup, profile, as_json, precision = parse_args(argv)
    problem = check_torchtitan()
    if problem:
        sys.exit(problem)
    warning = busy_warning()
    if warning:
        print(warning, file=sys.stderr)
    results = launch(cfg, rounds, warmup, profile, precision)
    summary = summarise(results, cfg, rounds, precision)
    if as_json:
        print(json.dumps(summary, indent=2))
    else:
        print_summary(summary)
    for mode, table in results[0]["profiles"].items():
        print(f"\n{mode}: one step on rank 0, top ops by self CPU time\n{table}", file=sys.stderr if as_json else None)


if __name__ == "__main__":
    main()
