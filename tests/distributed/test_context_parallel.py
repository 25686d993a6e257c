"""Context-parallel attention on CPU (gloo): torch's ring over the CPU SDPA op, per thread, with sharded batches.

Oracle: the full (unsharded) attention of the same inputs computed in one process, every rank building the same
full tensors from one seed. Each rank runs the ring on its shard (``context_batch``), the outputs and the gradients
of q, k, v (``(B, H, T, D)``, sequence on dim 2) are gathered back and compared in fp32 within 1e-5.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

from lightning_moe_overlap.parallel.context_attention import ContextParallelAttention
from lightning_moe_overlap.parallel.context_batch import gather_sequence, shard_batch, shard_sequence
from lightning_moe_overlap.parallel.context_ring_cpu import install_cpu_ring_attention
from tests.helpers.distributed import run_distributed

TOL = 1e-5
CASES = [  # (causal, kv heads): MHA and GQA (4 query heads)
    (True, 4),
    (True, 2),
    (False, 4),
    (False, 1),
]


def _qkv(kv_heads: int, seq: int = 16) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seq * 10 + kv_heads)
    q = torch.randn(2, 4, seq, 8, generator=g)
    k, v = (torch.randn(2, kv_heads, seq, 8, generator=g) for _ in range(2))
    return q, k, v, torch.randn(2, 4, seq, 8, generator=g)  # the last: the output's gradient


def _full(q, k, v, grad_out, causal: bool) -> list[torch.Tensor]:
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.size(1) != q.size(1))
    out.backward(grad_out)
    return [out.detach(), q.grad, k.grad, v.grad]


def _ring(rank, world, q, k, v, grad_out, causal, cp: ContextParallelAttention) -> list[torch.Tensor]:
    """This rank's shards through the ring under ``cp`` (entered by the caller), gathered back whole."""
    shard = [shard_sequence(t, world, rank, seq_dim=2, load_balance=cp.load_balance) for t in (q, k, v, grad_out)]
    q_s, k_s, v_s = (t.requires_grad_(True) for t in shard[:3])
    with cp.thread_context():
        out_s = F.scaled_dot_product_attention(q_s, k_s, v_s, is_causal=causal, enable_gqa=k.size(1) != q.size(1))
    out_s.backward(shard[3])
    group = cp.mesh.get_group()
    return [gather_sequence(t, group, seq_dim=2, load_balance=cp.load_balance) for t in (out_s.detach(), q_s.grad,
                                                                                          k_s.grad, v_s.grad)]


def _errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[float]:
    return [float((a - b).abs().max()) for a, b in zip(got, want, strict=True)]


def _ring_cases(rank: int, world: int, cases: list) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    errors = {}
    for causal, kv_heads in cases:
        cp = ContextParallelAttention(mesh, load_balance=causal)  # head-tail shards for causal, contiguous else
        q, k, v, grad_out = _qkv(kv_heads)
        with cp.enabled():
            got = _ring(rank, world, q, k, v, grad_out, causal, cp)
        errors[(causal, kv_heads)] = _errors(got, _full(q, k, v, grad_out, causal))
    return errors


def _assert_close(results: list[dict]) -> None:
    for rank, errors in enumerate(results):
        for case, (out, dq, dk, dv) in errors.items():
            assert max(out, dq, dk, dv) <= TOL, f"rank {rank}, (causal, kv heads)={case}: out/dq/dk/dv {errors[case]}"


def test_ring_attention_matches_full_attention() -> None:
    _assert_close(run_distributed(_ring_cases, 2, CASES))


@pytest.mark.long
def test_ring_attention_matches_full_attention_4_ranks() -> None:
    _assert_close(run_distributed(_ring_cases, 4, [(True, 2), (False, 4)]))


def _threads(rank: int, world: int) -> dict:
    """The attention run in a second thread: ring there under its own thread_context; a thread that did not enter
    one computes plain local attention; the backward, run from yet another thread, needs no mode; a checkpointed
    attention's recompute, inside that backward, gets one through ``context_fn``."""
    mesh = init_device_mesh("cpu", (world,))
    cp = ContextParallelAttention(mesh)
    q, k, v, grad_out = _qkv(4)
    result: dict = {}

    def lane() -> None:
        result["ring"] = _ring(rank, world, q, k, v, grad_out, True, cp)

    def bare() -> None:  # the main thread's mode (entered below) is not seen here
        q_s, k_s, v_s = (shard_sequence(t, world, rank, seq_dim=2) for t in (q, k, v))
        result["bare_local"] = torch.equal(
            F.scaled_dot_product_attention(q_s, k_s, v_s, is_causal=True),
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q_s, k_s, v_s, is_causal=True)[0],
        )

    with cp.enabled():
        worker = threading.Thread(target=lane)
        worker.start()
        worker.join()
        with cp.thread_context():
            other = threading.Thread(target=bare)
            other.start()
            other.join()
        # the backward of a ring forward run on this thread, called from another thread
        q_s, k_s, v_s = (shard_sequence(t, world, rank, seq_dim=2).requires_grad_(True) for t in (q, k, v))
        with cp.thread_context():
            out_s = F.scaled_dot_product_attention(q_s, k_s, v_s, is_causal=True)
        backward = threading.Thread(target=out_s.backward, args=(shard_sequence(grad_out, world, rank, seq_dim=2),))
        backward.start()
        backward.join()
        group = mesh.get_group()
        split_thread = [gather_sequence(t, group, seq_dim=2) for t in (out_s.detach(), q_s.grad, k_s.grad, v_s.grad)]
        # a checkpointed attention: its recompute runs inside that other thread's backward, through context_fn
        q_c, k_c, v_c = (shard_sequence(t, world, rank, seq_dim=2).requires_grad_(True) for t in (q, k, v))
        with cp.thread_context():
            out_c = checkpoint(_causal, q_c, k_c, v_c, use_reentrant=False, context_fn=cp.checkpoint_contexts)
        backward = threading.Thread(target=out_c.backward, args=(shard_sequence(grad_out, world, rank, seq_dim=2),))
        backward.start()
        backward.join()
        recomputed = [gather_sequence(t, group, seq_dim=2) for t in (out_c.detach(), q_c.grad, k_c.grad, v_c.grad)]
    full = _full(q, k, v, grad_out, True)
    return {
        "lane": _errors(result["ring"], full),
        "backward_thread": _errors(split_thread, full),
        "recompute": _errors(recomputed, full),
        "bare_local": result["bare_local"],
    }


def _causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.long
def test_attention_in_other_threads() -> None:
    for rank, got in enumerate(run_distributed(_threads, 2)):
        assert max(got["lane"]) <= TOL, f"rank {rank}: second-thread ring out/dq/dk/dv {got['lane']}"
        assert max(got["backward_thread"]) <= TOL, f"rank {rank}: backward from another thread {got['backward_thread']}"
        assert max(got["recompute"]) <= TOL, f"rank {rank}: checkpoint recompute in another thread {got['recompute']}"
        assert got["bare_local"], f"rank {rank}: a thread without thread_context() did not compute local attention"


def _torch_context_parallel(rank: int, world: int) -> list[float]:
    """torch's own ``context_parallel`` (monkey-patch mode, head-tail buffers) runs on CPU once the CPU op is in."""
    from torch.distributed.tensor.experimental import context_parallel

    install_cpu_ring_attention()
    mesh = init_device_mesh("cpu", (world,))
    q, k, v, grad_out = _qkv(4)
    shards = [t.clone() for t in (q, k, v, grad_out)]
    with context_parallel(mesh, buffers=shards, buffer_seq_dims=[2] * 4, no_restore_buffers=set(shards)):
        q_s, k_s, v_s = (t.requires_grad_(True) for t in shards[:3])
        out_s = F.scaled_dot_product_attention(q_s, k_s, v_s, is_causal=True)
        out_s.backward(shards[3])
    group = mesh.get_group()
    got = [gather_sequence(t, group, seq_dim=2) for t in (out_s.detach(), q_s.grad, k_s.grad, v_s.grad)]
    return _errors(got, _full(q, k, v, grad_out, True))


@pytest.mark.long
def test_torch_context_parallel_runs_on_cpu() -> None:
    for rank, errors in enumerate(run_distributed(_torch_context_parallel, 2)):
        assert max(errors) <= TOL, f"rank {rank}: torch's context_parallel out/dq/dk/dv {errors}"


class _RotaryAttention(nn.Module):
    """A tiny causal self-attention block with rotary position embeddings read from ``position_ids``."""

    def __init__(self, hidden: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)

    def _rotate(self, x_BHTD: torch.Tensor, position_ids_BT: torch.Tensor) -> torch.Tensor:
        half = self.head_dim // 2
        inv_freq_F = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
        angles_BTF = position_ids_BT[..., None].float() * inv_freq_F
        cos, sin = angles_BTF.cos()[:, None], angles_BTF.sin()[:, None]
        x1, x2 = x_BHTD[..., :half], x_BHTD[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    def forward(self, x_BTC: torch.Tensor, position_ids_BT: torch.Tensor) -> torch.Tensor:
        B, T, C = x_BTC.shape
        q, k, v = self.qkv(x_BTC).view(B, T, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = self._rotate(q, position_ids_BT), self._rotate(k, position_ids_BT)
        y_BHTD = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y_BHTD.transpose(1, 2).reshape(B, T, C))


def _rotary_block(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    block = _RotaryAttention()
    x_BTC = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(1))
    full_y = block(x_BTC, torch.arange(16).expand(2, 16))
    full_y.square().sum().backward()
    full_grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()

    mesh = init_device_mesh("cpu", (world,))
    cp = ContextParallelAttention(mesh)
    (x_STC,), position_ids = shard_batch(world, rank, x_BTC)
    with cp.enabled():
        with cp.thread_context():
            y_BSC = block(x_STC, position_ids)
        y_BSC.square().sum().backward()  # this rank's share of the same loss
    for p in block.parameters():  # the loss is a sum over all tokens: the cp ranks' gradients add up
        dist.all_reduce(p.grad, group=mesh.get_group())
    y = gather_sequence(y_BSC.detach(), mesh.get_group())
    return {"out": float((y - full_y.detach()).abs().max()),
            "grads": [float((p.grad - g).abs().max()) for p, g in zip(block.parameters(), full_grads, strict=True)]}


@pytest.mark.long
def test_rotary_block_with_global_positions_matches_unsharded() -> None:
    for rank, got in enumerate(run_distributed(_rotary_block, 2)):
        assert got["out"] <= TOL and max(got["grads"]) <= TOL, f"rank {rank}: {got}"
