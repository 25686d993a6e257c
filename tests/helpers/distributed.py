"""One helper to run a function on N gloo ranks on CPU, with per-rank results and errors brought back.

Workers must be module-level functions (they are pickled to the rank processes). Each worker is called as
``worker(rank, world_size, *args)`` after the default process group is initialised, and its return value comes
back to the caller. A failure on any rank raises in the caller with that rank's traceback.

Ranks start from a fork server (``multiprocessing``'s ``forkserver``): a clean process, started on first use, that
imports torch, Lightning and this package once (:data:`PRELOAD`); each rank is a fork of it. A spawned rank
imports them again, which takes seconds per rank on a loaded 2-core machine, for every test module. A fork-server
child is as fresh as a spawned process, except for the environment: it has the server's, so the caller's current
environment is passed and installed first.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_module
import time
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_moe_overlap.parallel import ParallelDims, ParallelGroups, build_mesh

PRELOAD = (
    "torch",
    "torch.distributed",
    "lightning.pytorch",
    "transformers",
    "lightning_moe_overlap",
    "lightning_moe_overlap.demo",
    "lightning_moe_overlap.demo_hf",
    "tests.helpers.distributed",
)


def _context() -> Any:
    """The ``forkserver`` context; the preload takes effect when this process starts its server (first use)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, world_size: int, port: int, timeout_s: float, worker: Callable, args: tuple, queue, env: dict
) -> None:
    os.environ.clear()
    os.environ.update(env)  # the caller's, as a spawned process would have it
    # LOCAL_RANK/NODE_RANK make a Lightning Trainer built inside the worker treat the processes as launched
    # externally (the torchrun path), so Trainer-level tests get per-rank results too.
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
        )
        result = worker(rank, world_size, *args)
        # Plain pickled bytes: a tensor sent as is travels by shared memory that dies with this process.
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - brought back to the caller with its traceback
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def mesh_groups(dims: ParallelDims, rank: int) -> ParallelGroups:
    """This rank's process groups of ``dims``, made as the strategy makes them: one CPU mesh's views
    (``build_mesh(dims, "cpu").process_groups(rank)``). Collective: every rank calls it with the same ``dims``."""
    return build_mesh(dims, "cpu").process_groups(rank)


def run_distributed(
    worker: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60.0
) -> list[Any]:
    """Run ``worker`` on ``world_size`` gloo ranks; return the list of per-rank results (index = rank)."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, timeout_s, worker, args, queue, env), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + 2 * timeout_s + 60
    for _ in range(world_size):
        try:
            rank, ok, payload = queue.get(timeout=max(1.0, deadline - time.monotonic()))
        except queue_module.Empty:
            missing = sorted(set(range(world_size)) - results.keys() - errors.keys())
            for p in procs:
                p.kill()
            errors.update({r: "no result before the deadline (hang?)" for r in missing})
            break
        if ok:
            results[rank] = pickle.loads(payload)
        else:
            errors[rank] = payload
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    if errors:
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise RuntimeError(f"{len(errors)} of {world_size} ranks failed:\n{text}")
    return [results[r] for r in range(world_size)]


def run_distributed_expect_errors(
    worker: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60.0
) -> dict[int, str]:
    """Like :func:`run_distributed`, but return ``{rank: traceback}`` of the ranks that failed (for error tests)."""
    try:
        run_distributed(worker, world_size, *args, timeout_s=timeout_s)
    except RuntimeError as err:
        text = str(err)
        out: dict[int, str] = {}
        for chunk in text.split("--- rank ")[1:]:
            head, _, body = chunk.partition(" ---\n")
            out[int(head)] = body
        return out
    return {}
