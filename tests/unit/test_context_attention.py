"""ContextParallelAttention on one rank (cp=1, the ring of one block is the plain op): its state and its refusals.

Oracle for the values: SDPA of the same tensors without context parallelism.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_moe_overlap._compat import torch as torch_compat
from lightning_moe_overlap.parallel.context_attention import ContextParallelAttention
from lightning_moe_overlap.parallel.context_ring_cpu import (
    CPU_FORWARD,
    cpu_ring_attention_installed,
    install_cpu_ring_attention,
)


def _qkv() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, 8, 4, generator=g) for _ in range(3)]


def test_install_is_idempotent_and_leaves_the_dispatcher_alone() -> None:
    install_cpu_ring_attention()
    assert cpu_ring_attention_installed()
    assert install_cpu_ring_attention() is False
    assert not torch_compat.cp_dispatcher_enabled()  # installing switches nothing on


def test_enabled_switches_the_dispatcher_for_the_block(world_of_one) -> None:
    cp = ContextParallelAttention(init_device_mesh("cpu", (1,)), load_balance=False)
    before = torch_compat.cp_load_balance()
    with cp.enabled():
        assert torch_compat.cp_dispatcher_enabled() and torch_compat.cp_load_balance() is False
    assert not torch_compat.cp_dispatcher_enabled() and torch_compat.cp_load_balance() is before


@pytest.mark.parametrize("causal", [True, False])
def test_one_rank_ring_equals_sdpa(world_of_one, causal: bool) -> None:
    cp = ContextParallelAttention(init_device_mesh("cpu", (1,)), load_balance=causal)
    q, k, v = _qkv()
    with cp.enabled(), cp.thread_context():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert not isinstance(out, DTensor)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal), atol=1e-6, rtol=0)


def test_a_two_dimensional_mesh_is_refused(world_of_one) -> None:
    with pytest.raises(ValueError, match=r"got a 2-D mesh .*Pass the cp dimension"):
        ContextParallelAttention(init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "cp")))


def test_thread_context_without_enabled_is_refused(world_of_one) -> None:
    cp = ContextParallelAttention(init_device_mesh("cpu", (1,)))
    with pytest.raises(RuntimeError, match=r"outside `ContextParallelAttention.enabled\(\)`.*Enter `enabled\(\)`"):
        with cp.thread_context():
            F.scaled_dot_product_attention(*_qkv(), is_causal=True)


def test_enabled_inside_enabled_is_refused(world_of_one) -> None:
    cp = ContextParallelAttention(init_device_mesh("cpu", (1,)))
    with cp.enabled():
        with pytest.raises(RuntimeError, match="already on .*not re-entrant.*Enter one of them once"):
            with cp.enabled():
                pass
        assert torch_compat.cp_dispatcher_enabled()  # the refused entry left the open one alone


def test_non_causal_under_load_balance_is_refused(world_of_one) -> None:
    cp = ContextParallelAttention(init_device_mesh("cpu", (1,)))
    with cp.enabled(), cp.thread_context():
        with pytest.raises(NotImplementedError, match=r"is_causal=False under .*load_balance=True.*load_balance=False"):
            F.scaled_dot_product_attention(*_qkv())


def test_mask_and_dtensor_inputs_are_refused(world_of_one) -> None:
    mesh = init_device_mesh("cpu", (1,))
    cp = ContextParallelAttention(mesh)
    q, k, v = _qkv()
    with cp.enabled(), cp.thread_context():
        with pytest.raises(NotImplementedError, match="got an attn_mask under context parallelism.*is_causal=True"):
            F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool), is_causal=True)
        q_d = DTensor.from_local(q, mesh, (Replicate(),), run_check=False)
        with pytest.raises(NotImplementedError, match="got DTensor query/key/value.*use_local_output=True"):
            F.scaled_dot_product_attention(q_d, k, v, is_causal=True)


def test_cpu_handler_refuses_dropout_and_other_placements(world_of_one) -> None:
    mesh = init_device_mesh("cpu", (1,))
    cp = ContextParallelAttention(mesh)
    q, k, v = _qkv()
    with cp.enabled():
        sharded = [DTensor.from_local(t, mesh, (Shard(2),), run_check=False) for t in (q, k, v)]
        with pytest.raises(NotImplementedError, match=r"dropout_p=0.1 under context parallelism on CPU.*0\.0"):
            CPU_FORWARD(*sharded, 0.1, True)
        replicated = [DTensor.from_local(t, mesh, (Replicate(),), run_check=False) for t in (q, k, v)]
        with pytest.raises(NotImplementedError, match=r"placements .*Replicate.*sharded on the sequence only"):
            CPU_FORWARD(*replicated, 0.0, True)
        with pytest.raises(NotImplementedError, match="got an attn_mask under context parallelism"):
            mask = DTensor.from_local(torch.zeros(1, 2, 8, 8), mesh, (Shard(2),), run_check=False)  # as torch wraps it
            CPU_FORWARD(*sharded, 0.0, False, attn_mask=mask)


class _Counting(ContextParallelAttention):
    """Counts the SDPA calls routed to the ring."""

    calls = 0

    def _ring_sdpa(self, func, args, kwargs):  # type: ignore[no-untyped-def, override]
        self.calls += 1
        return super()._ring_sdpa(func, args, kwargs)


def _attention(x: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(x, x, x, is_causal=True)


@pytest.mark.parametrize("with_context_fn", [False, True])
def test_a_recompute_sees_the_mode_only_through_context_fn(world_of_one, with_context_fn: bool) -> None:
    from torch.utils.checkpoint import checkpoint

    cp = _Counting(init_device_mesh("cpu", (1,)))
    x = torch.randn(1, 2, 8, 4, requires_grad=True)
    extra = {"context_fn": cp.checkpoint_contexts} if with_context_fn else {}
    with cp.enabled():
        with cp.thread_context():
            out = checkpoint(_attention, x, use_reentrant=False, **extra)
        assert cp.calls == 1  # nested modes (thread_context + checkpoint's) route the call once
        with cp.thread_context():  # entered around backward(): autograd does not run the recompute under it
            if with_context_fn:
                out.sum().backward()
            else:
                # the recompute runs plain SDPA: its saved tensors are not the ring's DTensors, and the backward says so
                with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
                    out.sum().backward()
    assert cp.calls == (2 if with_context_fn else 1)
