"""The memory estimate of ``check`` (``cli/memory/``) against oracles that do not share its code: the tensors a real
CPU model and optimizer step hold (pp=1, ep=1), hand arithmetic from the model's sizes for the ep / shard / pp
layouts, the saved tensors of a real forward, and torch's own schedule orders for the micro-batches in flight."""

from __future__ import annotations

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from lightning_moe_overlap.cli.memory.activations import ActivationPolicy, LayerShape, chunk_activations
from lightning_moe_overlap.cli.memory.estimate import MemorySettings, estimate_memory, policy_of
from lightning_moe_overlap.cli.memory.in_flight import peak_bytes, pp1_in_flight
from lightning_moe_overlap.cli.memory.optimizer_state import optimizer_state
from lightning_moe_overlap.cli.memory.table import memory_table, memory_warnings, parse_memory_gb
from lightning_moe_overlap.config import OverlapConfig
from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.pipeline.schedules import compute_order

SIZES = {"vocab_size": 256, "hidden_size": 64, "num_heads": 4, "num_experts": 8, "top_k": 2, "ffn_hidden_size": 128}


def _meta(num_layers: int = 2) -> MoEGPT:
    with torch.device("meta"):
        return MoEGPT(num_layers=num_layers, **SIZES)


def _estimate(cfg: OverlapConfig, world: int, num_layers: int = 2, **settings):
    model = _meta(num_layers)
    split = None
    if cfg.pp > 1:
        from lightning_moe_overlap.config.pipeline_layout import build_layout
        from lightning_moe_overlap.pipeline.split import split_model

        split = split_model(model, build_layout(num_layers, cfg.pp, cfg.resolved_vpp, None))
    rows, notes = estimate_memory(model, cfg, MemorySettings(world_size=world, **settings), split)
    return rows, notes


def test_one_process_matches_a_real_adamw_step():
    torch.manual_seed(0)
    model = MoEGPT(num_layers=2, **SIZES)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model._loss(torch.randint(0, 256, (2, 17))).backward()
    opt.step()
    params = sum(p.nbytes for p in model.parameters())
    grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    state = sum(t.nbytes for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    (row,), notes = _estimate(OverlapConfig(ep=1), world=1)
    assert notes == [] or all("activations unknown" in n for n in notes)
    assert (row.held.params, row.held.grads, row.held.optimizer) == (params, grads, state)
    dense = sum(p.nbytes for n, p in model.named_parameters() if ".experts." not in n)
    assert row.held.gathered == dense  # FSDP's gathered copy of the dense parameters at shard="none"


# Per layer, elements: attn_norm 64, qkv 192*64, proj 64*64, mlp_norm 64, router 8*64; experts 8*256*64 + 8*64*128.
DENSE_LAYER = 64 + 192 * 64 + 64 * 64 + 64 + 8 * 64  # 17024
EXPERTS_LAYER = 8 * 256 * 64 + 8 * 64 * 128  # 196608
ENDS = 256 * 64 + 64 + 256 * 64  # embedding, final norm, head


def test_ep2_full_sharding_by_hand():
    # world 4, ep 2: dense sharded over dp=4 (ceil rows), experts E/ep=4 rows over edp=2.
    dense_shard = 64 * 64 + 2 * (16 + 48 * 64 + 16 * 64 + 16 + 2 * 64) + 16 + 64 * 64  # 16720
    experts_shard = 2 * (2 * 256 * 64 + 2 * 64 * 128)  # 98304
    full = 2 * DENSE_LAYER + ENDS + 2 * EXPERTS_LAYER // 2
    (row,), _ = _estimate(OverlapConfig(ep=2, shard="full"), world=4)
    assert row.held.params == 4 * (dense_shard + experts_shard)
    assert row.held.gathered == row.held.grads == 4 * full
    assert row.held.grads_after == row.held.params
    assert row.held.optimizer == 2 * 4 * (dense_shard + experts_shard) + 4 * 17  # + 17 float32 `step`s


def test_fsdp_padding_on_dim0():
    # world 3, ep 1: every dim 0 padded to a multiple of 3 (256 -> 86 rows, 64 -> 22, 192 -> 64, 8 -> 3).
    dense = 86 * 64 + 2 * (22 + 64 * 64 + 22 * 64 + 22 + 3 * 64) + 22 + 86 * 64
    experts = 2 * (3 * 256 * 64 + 3 * 64 * 128)
    (row,), _ = _estimate(OverlapConfig(shard="optimizer"), world=3)
    assert row.held.params == 4 * (dense + experts)
    assert row.held.gathered == 4 * (2 * DENSE_LAYER + ENDS + 2 * EXPERTS_LAYER)


def test_pp2_vpp2_each_rank_holds_its_chunks():
    # 4 layers, chunks E+l0 | l1 | l2 | l3+L: rank 0 holds chunks 0, 2; rank 1 chunks 1, 3; ep 2 halves the experts.
    cfg = OverlapConfig(ep=2, pp=2, vpp=2, num_microbatches=4)
    rows, _ = _estimate(cfg, world=4, num_layers=4)
    assert [r.chunks for r in rows] == [(0, 2), (1, 3)]
    assert rows[0].held.params == 4 * (256 * 64 + 2 * DENSE_LAYER + 2 * EXPERTS_LAYER // 2)
    assert rows[1].held.params == 4 * (64 + 256 * 64 + 2 * DENSE_LAYER + 2 * EXPERTS_LAYER // 2)


def test_bf16_true_and_offload():
    (row,), _ = _estimate(OverlapConfig(optimizer_cpu_offload=True), world=1, precision="bf16-true")
    n = 2 * DENSE_LAYER + ENDS + 2 * EXPERTS_LAYER
    assert row.held.params == row.held.grads == 2 * n
    assert row.held.optimizer == 0
    # float32 master + its gradient, two bf16 staging buffers, AdamW's two float32 states, 17 `step`s
    assert row.held.host == n * (4 + 4 + 2 + 2 + 8) + 4 * 17


@pytest.mark.parametrize(
    "name,hparams,states,known",
    [("AdamW", {}, 2, True), ("Adam", {"amsgrad": True}, 3, True), ("SGD", {"momentum": 0.9}, 1, True),
     ("SGD", {}, 0, True), ("Lion", {}, 0, False)],
)  # fmt: skip
def test_optimizer_states(name, hparams, states, known):
    got = optimizer_state(name, hparams)
    assert (got.states, got.known) == (states, known)


def test_an_unknown_optimizer_is_named():
    _, notes = _estimate(OverlapConfig(), world=1, optimizer=("Lion", {}))
    assert any("'Lion' unknown" in n for n in notes)


def _saved_bytes(model: MoEGPT, tokens: torch.Tensor) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        model._loss(tokens)
    return sum(seen.values())


@pytest.mark.parametrize("batch,seq,layers", [(4, 64, 2), (2, 128, 3)])
def test_activations_match_the_saved_tensors_of_a_real_forward(batch, seq, layers):
    torch.manual_seed(0)
    model = MoEGPT(num_layers=layers, **SIZES)
    measured = _saved_bytes(model, torch.randint(0, 256, (batch, seq + 1)))
    shape = LayerShape(batch=batch, seq=seq, hidden=64, heads=4, top_k=2, ffn=128, num_experts=8, vocab=256)
    estimate = chunk_activations(shape, layers, embedding=True, loss=True).device
    assert abs(estimate / measured - 1) < 0.03, (estimate, measured)


def test_recompute_and_offload_reduce_the_device_part():
    shape = LayerShape(batch=4, seq=64, hidden=64, heads=4, top_k=2, ffn=128, num_experts=8, vocab=256)
    plain = chunk_activations(shape, 2, embedding=True, loss=True)
    act = chunk_activations(shape, 2, embedding=True, loss=True, policy=ActivationPolicy(recompute=("moe_act",)))
    assert plain.device - act.device == 2 * (256 * 2) * 128 * 4  # the activation's output, A * F, per layer
    off = chunk_activations(shape, 2, embedding=True, loss=True,
                            policy=ActivationPolicy(offload=("dispatched_input",), offload_min_bytes=0))  # fmt: skip
    assert (plain.device - off.device, off.host) == (2 * 512 * 64 * 4, 2 * 512 * 64 * 4)
    full = chunk_activations(shape, 2, embedding=True, loss=True, policy=ActivationPolicy(full_layers=2))
    assert full.device < act.device
    assert policy_of([{"class_path": "x.SelectiveRecompute", "init_args": {"modules": ["moe_act"]}}]).recompute == (
        "moe_act",
    )


def test_in_flight_counts_follow_the_schedules():
    assert (pp1_in_flight(4, True), pp1_in_flight(4, False), pp1_in_flight(1, True)) == (2, 1, 1)
    order = compute_order("1f1b", pp=2, vpp=1, num_microbatches=4, overlap=False)
    assert peak_bytes(order[0], {0: 1})[0] == 2  # stage s of 1F1B holds pp - s micro-batches
    assert peak_bytes(order[1], {1: 1})[0] == 1
    inter = compute_order("interleaved_1f1b", pp=2, vpp=2, num_microbatches=4, overlap=False)
    assert peak_bytes(inter[0], {0: 1, 2: 1})[0] > 2


def test_memory_gb_must_be_positive():
    assert parse_memory_gb("80") == 80.0
    for bad in ("0", "-3", "lots", "nan"):
        with pytest.raises(ValueError, match=r"--memory-gb=.* is not a positive number.*Pass e.g. `--memory-gb 80`"):
            parse_memory_gb(bad)


def test_table_and_warning():
    rows, notes = _estimate(OverlapConfig(ep=2), world=2, micro_batch=2, seq_len=32)
    text = memory_table(rows, notes)
    assert "params" in text and "activ" in text and "pp 0" in text
    assert rows[0].activations is not None and rows[0].activations > 0
    (warning,) = memory_warnings(rows, 1000, "--memory-gb 1e-06")
    assert "pp rank 0 needs about" in warning and "--memory-gb 1e-06" in warning
    assert "more than the 0.001 MiB of the device" in warning  # in the limit's scale: not "0.000 GiB"
    mib = rows[0].device_total / (1 << 20)
    assert f"needs about {mib:.3f} MiB per process" in warning
    assert memory_warnings(rows, None, "") == []
