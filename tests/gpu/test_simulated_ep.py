"""Simulated expert parallelism on one GPU: one NCCL rank, every all-to-all a loopback on a side stream after a
calibrated ``torch.cuda._sleep``, ``wait()`` stream-ordered. Overlapped and sequential training end bitwise equal
under deterministic algorithms; host syncs are counted; the trace shows the sleep kernels."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import overlap as bench  # noqa: E402
from simulated_ep import make_deterministic  # noqa: E402

from lightning_moe_overlap.moe.dispatch.loopback import Loopback  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="Requires: CUDA (side stream, torch.cuda._sleep)"),
]


@pytest.fixture
def one_rank_nccl():
    deterministic = torch.are_deterministic_algorithms_enabled()
    make_deterministic()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch.use_deterministic_algorithms(deterministic)


def test_cuda_loopback_wait_orders_the_compute_stream() -> None:
    inp = torch.randn(1024, 64, device="cuda")
    out = torch.empty_like(inp)
    work = Loopback(0.02, "cuda")(out, inp)  # 20 ms of sleep before the copy
    work.wait()
    assert torch.equal(out.clone(), inp)  # the clone runs on the compute stream, after the wait


def test_simulated_ep_on_one_gpu(one_rank_nccl: None, tmp_path: Path) -> None:
    trace = tmp_path / "step.json"
    cfg, _ = bench.parse_args([
        "--device", "cuda", "--simulate-ep", "1", "--layers", "2", "--hidden", "256", "--ffn", "128",
        "--dense-ffn", "256", "--tokens", "256", "--microbatches", "4", "--steps", "2", "--warmup", "1",
        "--trace", str(trace),
    ])
    result = bench.rank_main(0, cfg)
    assert result["bitwise_equal"] is True
    summary = bench.summarise([result], cfg)
    assert isinstance(summary["simulated"]["host_syncs_per_step"], int)
    names = [e.get("name", "") for e in json.loads(trace.read_text())["traceEvents"]]
    assert any("sleep" in name.lower() or "spin_kernel" in name for name in names)  # torch.cuda._sleep's kernel
