"""Per-token sums on CUDA without atomics, at top-8: the combine, the gathers' backward and the deduplicated sums
give the CPU's bits on every run, and overlapped training stays bitwise equal to sequential training with torch's
deterministic algorithms off (atomic ``index_add_`` would reorder the additions from run to run)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_moe_overlap.moe.dispatch.dedup import sum_per_token, token_rows
from lightning_moe_overlap.moe.permute import gather_rows, scatter_weighted

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="Requires: CUDA (atomic adds are a CUDA behaviour)"),
]

TOKENS, TOP_K, DIM, RANKS = 4096, 8, 64, 4


@pytest.fixture
def atomics_allowed() -> Iterator[None]:
    """Torch's deterministic algorithms off: ``index_add_`` on CUDA would run with atomics."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic)


def _sums(device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """Forward and input gradients of every per-token sum, from the same CPU-made inputs."""
    g = torch.Generator().manual_seed(0)
    assign_A = torch.randperm(TOKENS * TOP_K, generator=g)[: TOKENS * TOP_K - 100].to(device)
    x = torch.randn(TOKENS, DIM, generator=g).to(device, dtype).requires_grad_()
    y = torch.randn(assign_A.numel(), DIM, generator=g).to(device, dtype).requires_grad_()
    weights = torch.rand(TOKENS, TOP_K, generator=g).to(device)
    token_U = torch.arange(TOKENS).repeat(RANKS).to(device)  # every token to every rank: RANKS rows per token
    y_U = torch.randn(token_U.numel(), DIM, generator=g).to(device, dtype).requires_grad_()
    g_rows = torch.randn(assign_A.numel(), DIM, generator=g).to(device, dtype)
    g_sent = torch.randn(token_U.numel(), DIM, generator=g).to(device, dtype)
    rows = gather_rows(x, assign_A, TOP_K)
    out = scatter_weighted(y, assign_A, weights, TOKENS, dtype)
    per_token = sum_per_token(y_U, token_U, TOKENS, RANKS)
    sent = token_rows(x, token_U, RANKS)
    torch.autograd.backward([rows, out, per_token, sent], [g_rows, out.detach(), per_token.detach(), g_sent])
    return [t.detach().cpu() for t in (out, per_token, x.grad, y.grad, y_U.grad)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sums_on_cuda_give_the_cpu_bits_on_every_run(atomics_allowed: None, dtype: torch.dtype) -> None:
    cpu = _sums("cpu", dtype)
    for _ in range(3):
        for got, want in zip(_sums("cuda", dtype), cpu, strict=True):
            assert torch.equal(got, want)


@pytest.fixture
def one_rank_nccl(atomics_allowed: None) -> Iterator[None]:
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dedup", [False, True], ids=["plain", "dedup"])
def test_top8_overlap_bitwise_equal_to_sequential(one_rank_nccl: None, dedup: bool) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import overlap as bench  # noqa: PLC0415 - the benchmark's model and modes

    cfg, _ = bench.parse_args([
        "--device", "cuda", "--simulate-ep", "1", "--layers", "2", "--hidden", "256", "--ffn", "128",
        "--dense-ffn", "256", "--experts", "16", "--top-k", str(TOP_K), "--tokens", "1024", "--microbatches", "4",
        "--steps", "2", "--warmup", "1", *(["--dedup"] if dedup else []),
    ])
    assert not torch.are_deterministic_algorithms_enabled()
    result = bench.rank_main(0, cfg)
    assert result["bitwise_equal"] is True  # sequential, overlap and overlap+wgrad end with the same parameters
