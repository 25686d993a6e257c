"""FP8 dispatch on the deduplicated all-to-all path (``dedup=True``) on 2 gloo ranks (ep=2).

Each unique (token, destination rank) row is sent once, in e4m3 with a float32 scale; the experts get the same
``Float8Rows`` as on the plain path. Oracles: with ``rowwise`` the first FP8 GEMM quantises each row exactly as the
dispatch does, so the output and every gradient are bitwise those of the deduplicated high-precision dispatch (FP8
GEMMs either way) and, up to top-2, of the plain path's FP8 dispatch; the bytes of the token exchange, ``D + 4`` per
unique row, with the unique rows counted from the routing (the distinct ranks of each token's choices). Under the
strategy (``fp8="rowwise", alltoall_dedup=True``), the overlapped step is bitwise the sequential one, and a counter
installed at test time around the deduplicated FP8 exchange (``dedup.py``'s ``float8_all_to_all_many``) counts one
per MoE layer forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.fp8 import apply_fp8
from lightning_moe_overlap.moe import Experts, apply_expert_parallel
from lightning_moe_overlap.moe.dispatch import dedup
from lightning_moe_overlap.parallel.dtensors import local
from tests.distributed.test_fp8_strategy import Tokens, _model
from tests.helpers.distributed import run_distributed
from tests.helpers.traffic import Recording
from tests.unit.test_dispatch_flex import CountingRuntime

WORLD, E, D, F = 2, 8, 32, 16
MICRO, STEPS, BATCH, LAYERS = 2, 2, 4, 2
CASES = (  # (name, top_k, dtype)
    ("random", 2, torch.float32),
    ("same_rank", 2, torch.float32),
    ("empty_rank", 2, torch.float32),
    ("random", 2, torch.bfloat16),
    ("random", 3, torch.float32),
)


def _routing(case: str, rank: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * rank + top_k)
    num_tokens = 0 if case == "empty_rank" and rank == 1 else 9
    x = torch.randn(num_tokens, D, generator=g)
    idx = torch.zeros(num_tokens, top_k, dtype=torch.long)
    for t in range(num_tokens):
        idx[t] = torch.randperm(E, generator=g)[:top_k]
    if case == "same_rank":  # both choices on one rank: one row per token crosses, not two
        idx = torch.stack([idx[:, 0], idx[:, 0] // 4 * 4 + (idx[:, 0] + 1) % 4], dim=1)
    return x, idx, torch.rand(num_tokens, top_k, generator=g)


def _experts_run(group, case: str, top_k: int, dtype: torch.dtype, fp8_dispatch: bool, use_dedup: bool) -> dict:
    rank = dist.get_rank(group)
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"experts": Experts(E, D, F, impl="loop", dtype=dtype)})
    runtime, traffic = CountingRuntime(), Recording()
    runtime.attach(traffic)
    (ep_mod,) = apply_expert_parallel(model, group, runtime=runtime, dedup=use_dedup)
    apply_fp8(ep_mod, "rowwise", dense=False)
    ep_mod.fp8_dispatch = fp8_dispatch
    x, idx, w = _routing(case, rank, top_k)
    x, w = x.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
    out = ep_mod(x, idx, w)
    out.float().pow(2).sum().backward()
    return {
        "tensors": [out.detach(), x.grad, w.grad, *(p.grad for p in ep_mod.parameters())],
        "bytes": traffic.each,
        "handoffs": runtime.handoffs,
        "unique_rows": sum(len(set((row // (E // WORLD)).tolist())) for row in idx),
    }


def _fit(overlap: bool) -> dict:
    torch.manual_seed(0)
    model = _model("moegpt")
    grads: list[list[torch.Tensor]] = []
    losses: list[torch.Tensor] = []
    model.on_before_optimizer_step = lambda optimizer: grads.append(
        [local(p.grad).clone() for p in model.parameters() if p.grad is not None]
    )
    model.on_train_batch_end = lambda outputs, *_: losses.append(outputs["loss"].detach().clone())
    strategy = MoEOverlapStrategy(ep=WORLD, num_microbatches=MICRO, overlap=overlap, fp8="rowwise", alltoall_dedup=True)
    trainer = Trainer(
        accelerator="cpu", devices=WORLD, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        strategy=strategy,
    )  # fmt: skip
    exchange, calls = dedup.float8_all_to_all_many, []

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return exchange(*args, **kwargs)

    dedup.float8_all_to_all_many = counted
    try:
        trainer.fit(model, train_dataloaders=DataLoader(Tokens(STEPS * BATCH), batch_size=BATCH))
    finally:
        dedup.float8_all_to_all_many = exchange
    return {"grads": grads, "losses": losses, "fp8_dispatches": len(calls)}


def _worker(rank: int, world: int) -> dict:
    group = dist.group.WORLD
    experts = {}
    for case, top_k, dtype in CASES:
        runs = {
            (fp8_dispatch, use_dedup): _experts_run(group, case, top_k, dtype, fp8_dispatch, use_dedup)
            for fp8_dispatch, use_dedup in ((True, True), (False, True), (True, False))
        }
        experts[f"{case}-k{top_k}-{dtype}"] = {"top_k": top_k, "dtype": dtype, **runs}
    return {"experts": experts, "overlapped": _fit(True), "sequential": _fit(False)}


def _bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_fp8_dedup_dispatch_on_two_ranks() -> None:
    results = run_distributed(_worker, WORLD, timeout_s=120)
    for rank, result in enumerate(results):
        for key, runs in result["experts"].items():
            fp8, high, plain = runs[(True, True)], runs[(False, True)], runs[(True, False)]
            where = f"rank {rank} {key}"
            # bitwise the deduplicated high-precision dispatch, with the same hand-overs; the plain path's up to top-2
            assert _bitwise(fp8["tensors"], high["tensors"]) and fp8["handoffs"] == high["handoffs"], where
            if runs["top_k"] <= 2:
                assert _bitwise(fp8["tensors"], plain["tensors"]), where
            # collectives: counts, then the rows and their routing data at one comm point, ...: only the rows change
            unique_rows, width = fp8["unique_rows"], 2 if runs["dtype"] == torch.bfloat16 else 4
            assert fp8["bytes"][1] == (D + 4) * unique_rows and high["bytes"][1] == width * D * unique_rows, where
            assert fp8["bytes"][0] == high["bytes"][0] and fp8["bytes"][2:] == high["bytes"][2:], where
        same_rank = result["experts"]["same_rank-k2-torch.float32"]
        assert same_rank[(True, True)]["bytes"][1] * 2 == same_rank[(True, False)]["bytes"][1]  # one row, not two
        overlapped, sequential = result["overlapped"], result["sequential"]
        assert overlapped["fp8_dispatches"] == sequential["fp8_dispatches"] == STEPS * MICRO * LAYERS, rank
        assert len(overlapped["grads"]) == STEPS, rank
        for step, (got, want) in enumerate(zip(overlapped["grads"], sequential["grads"], strict=True)):
            assert _bitwise(got, want), f"rank {rank} step {step}"
        assert _bitwise(overlapped["losses"], sequential["losses"]), rank
