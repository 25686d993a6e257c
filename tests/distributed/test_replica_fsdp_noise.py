"""The FSDP2 the strategy applies on its own at ``shard="none"`` stays quiet on 2 gloo ranks: a model whose output
is a view (a biased ``Linear`` on 3-D input), on which torch's ``fully_shard`` warns when the user applies it, trains
without torch's "returned a view tensor" warning on any rank."""

from __future__ import annotations

import warnings

import torch
from lightning.pytorch import Trainer
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo import MoEGPT, SyntheticTokens
from tests.helpers.distributed import run_distributed

VIEW = "returned a view tensor"


class BiasedHead(MoEGPT):
    """``MoEGPT`` with a biased output layer: its logits ``[B, S, V]`` are a view of a 2-D ``addmm``."""

    def __init__(self) -> None:
        super().__init__(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_experts=4, ffn_hidden_size=16)
        self.head = nn.Linear(16, 32, bias=True)


def _view_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if VIEW in str(w.message)]


def _worker(rank: int, world: int) -> dict[str, object]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # the oracle that torch warns for this output: the user's own fully_shard of a biased Linear on 3-D input
        mine = fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (world,)))
        mine(torch.randn(2, 3, 4, requires_grad=True)).sum().backward()
        users = _view_warnings(caught)
        caught.clear()
        trainer = Trainer(
            accelerator="cpu", devices=world, max_steps=2, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
            strategy=MoEOverlapStrategy(ep=2, num_microbatches=2),  # shard="none": replicas through fully_shard
        )
        model = BiasedHead()
        trainer.fit(model, datamodule=SyntheticTokens(vocab_size=32, seq_len=8, batch_size=4))
        from_strategy = _view_warnings(caught)
    logits = model(torch.zeros(1, 4, dtype=torch.long))
    wrapped, view = type(model).__name__, logits._base is not None
    return {"users": users, "from_strategy": from_strategy, "wrapped": wrapped, "view": view}


def test_replicas_fsdp_does_not_warn_about_views_but_the_users_fsdp_does() -> None:
    for result in run_distributed(_worker, 2, timeout_s=120):
        assert result["users"], "torch no longer warns on a fully_shard module returning a view: drop the filter"
        assert result["wrapped"] == "FSDPBiasedHead" and result["view"]  # the strategy's FSDP, and a view output
        assert result["from_strategy"] == []
