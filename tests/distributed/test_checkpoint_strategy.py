"""Checkpoints of MoEOverlapStrategy on 4 gloo ranks, every scenario in one spawn (overlap on, 2 micro-batches).

Run A trains 2 epochs at ep=4 and saves a sharded checkpoint at each epoch end. Oracles:
- exact resume: run B resumes A's epoch-0 checkpoint at ep=4; its parameters after epoch 1 are bitwise A's
  (model, per-expert Adam state, LR scheduler, loop progress and the dropout RNG all restored);
- resharding ep=4 -> ep=2: run C resumes the same checkpoint at ep=2; the experts and their Adam state it loaded
  are bitwise the ones A saved, and it continues A's loss curve;
- resharding ep=2 -> ep=1 and ep=4: runs D (ep=1) and E (ep=4) load C's final checkpoint; their experts and Adam
  state are bitwise C's (and ``validate(ckpt_path=...)`` at ep=2 loads the same experts), and so are those of an
  unsharded model loading it in the test's own process, with no process group;
- consolidated export (C's final state, an HF model at ep=2) loads into the unsharded models with the same outputs;
- a checkpoint with another number of experts is refused on every rank with the same message.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.checkpoint import consolidate_checkpoint, load_consolidated_state_dict
from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.demo_hf import HFMoECausalLM, build_hf_model
from lightning_moe_overlap.moe.ep import ExpertParallelExperts
from lightning_moe_overlap.parallel.dtensors import local
from tests.helpers.data import RandomTokens
from tests.helpers.distributed import run_distributed

WORLD, BATCH, MICRO, STEPS_PER_EPOCH, VOCAB = 4, 4, 2, 2, 32
CONFIG = dict(vocab_size=VOCAB, hidden_size=16, num_layers=1, num_heads=2, num_experts=8, top_k=2, ffn_hidden_size=8)
EPOCH0 = f"epoch=0-step={STEPS_PER_EPOCH}.ckpt"
EPOCH1 = f"epoch=1-step={2 * STEPS_PER_EPOCH}.ckpt"


class Tokens(RandomTokens):
    def __init__(self, n: int = WORLD * BATCH * STEPS_PER_EPOCH, seq: int = 9) -> None:
        super().__init__(n, seq, VOCAB, seed=3)


def _probe() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(5))


class GPT(MoEGPT):
    """The demo model plus dropout (so the RNG state matters), an LR schedule, and records of what it held."""

    def __init__(self, seed: int = 0, **overrides) -> None:
        super().__init__(**{**CONFIG, **overrides}, seed=seed)
        self.losses: list[float] = []
        self.saved: dict[int, dict] = {}
        self.started: dict | None = None

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        x_BSD = F.dropout(self.embed(tokens_BS), p=0.2, training=self.training)
        for layer in self.layers:
            x_BSD = layer(x_BSD)
        return self.head(self.norm(x_BSD))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Tokens(), batch_size=BATCH, shuffle=True, drop_last=True)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_save_checkpoint(self, checkpoint) -> None:
        self.saved[self.trainer.global_step] = held_experts(self, self.trainer.optimizers[0])

    def on_train_start(self) -> None:  # after the restore
        self.started = held_experts(self, self.trainer.optimizers[0])


def held_experts(module, optimizer) -> dict:
    """``{name: (first expert, weights [n, ...], Adam exp_avg [n, ...])}`` of the experts this rank holds."""
    out = {}
    for prefix, child in module.named_modules():
        if isinstance(child, ExpertParallelExperts):
            for name, p in child.named_parameters(recurse=False):
                state = optimizer.state.get(p, {}) if optimizer is not None else {}
                moment = local(state["exp_avg"]).clone() if "exp_avg" in state else None
                out[f"{prefix}.{name}"] = (child.expert_shard.first_expert, local(p).detach().clone(), moment)
    return out


def _trainer(root: Path, ep: int, epochs: int, **strategy) -> Trainer:
    return Trainer(
        accelerator="cpu", devices=WORLD, max_epochs=epochs, logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=root,
        callbacks=[ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=1)],
        strategy=MoEOverlapStrategy(ep=ep, num_microbatches=MICRO, **strategy),
    )


def _fit(root: Path, ep: int, *, ckpt: Path | None = None, seed: int = 0, epochs: int = 2) -> tuple[Trainer, GPT]:
    model = GPT(seed=seed)
    trainer = _trainer(root, ep, epochs)
    trainer.fit(model, ckpt_path=ckpt)
    return trainer, model


def _params(model) -> list[torch.Tensor]:
    return [local(p).detach().clone() for p in model.parameters()]


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():  # every rank runs it: the experts' all-to-all is collective
        return model(tokens)


def _export_hf(root: Path) -> torch.Tensor:
    class HF(HFMoECausalLM):
        def train_dataloader(self):
            return DataLoader(Tokens(), batch_size=BATCH, drop_last=True)

    model = HF("qwen3_moe")
    trainer = Trainer(
        accelerator="cpu", devices=WORLD, max_steps=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
        strategy=MoEOverlapStrategy(ep=2, num_microbatches=MICRO, checkpoint_format="consolidated"),
    )
    trainer.fit(model)
    trainer.save_checkpoint(root / "hf.ckpt")
    model.eval()
    with torch.no_grad():
        return model.model(input_ids=_probe()).logits


def _validate(root: Path) -> dict:
    """``validate(ckpt_path=...)`` loads the model part (no optimizer) at ep=2."""
    model = GPT(seed=3)
    trainer = Trainer(
        accelerator="cpu", devices=WORLD, logger=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=1, strategy=MoEOverlapStrategy(ep=2, num_microbatches=MICRO),
    )
    trainer.validate(model, DataLoader(Tokens(), batch_size=BATCH), ckpt_path=root / "c" / EPOCH1)
    return held_experts(model, None)


def _refused(root: Path) -> str:
    try:
        trainer = _trainer(root / "refused", ep=2, epochs=2)
        trainer.fit(GPT(num_experts=4), ckpt_path=root / "a" / EPOCH0)
    except ValueError as err:
        return str(err)
    return "no error"


def _worker(rank: int, world: int, root: Path) -> dict:
    torch.set_num_threads(1)
    _, a = _fit(root / "a", ep=4)
    _, b = _fit(root / "b", ep=4, ckpt=root / "a" / EPOCH0, seed=1)
    trainer_c, c = _fit(root / "c", ep=2, ckpt=root / "a" / EPOCH0, seed=1)
    trainer_c.strategy.checkpoint_format = "consolidated"
    trainer_c.save_checkpoint(root / "c_full.ckpt")
    c_logits = _logits(c, _probe())
    _, d = _fit(root / "d", ep=1, ckpt=root / "c" / EPOCH1, seed=2)
    _, e = _fit(root / "e", ep=4, ckpt=root / "c" / EPOCH1, seed=2)
    return {
        "a": {"losses": a.losses, "params": _params(a), "saved": a.saved},
        "b": {"losses": b.losses, "params": _params(b)},
        "c": {"losses": c.losses, "started": c.started, "saved": c.saved, "logits": c_logits},
        "d": {"held": held_experts(d, d.trainer.optimizers[0]), "losses": d.losses},
        "e": {"held": held_experts(e, e.trainer.optimizers[0]), "losses": e.losses},
        "validated": _validate(root),
        "hf_logits": _export_hf(root),
        "refused": _refused(root),
    }


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def results(root) -> list[dict]:
    return run_distributed(_worker, WORLD, root, timeout_s=240)


def _full(per_rank: list[dict], which: int) -> dict[str, torch.Tensor]:
    """Each expert tensor ([E, ...]) from what the ranks held; replicas of one expert must agree bitwise."""
    full: dict[str, dict[int, torch.Tensor]] = {}
    for held in per_rank:
        for name, entry in held.items():
            first, tensor = entry[0], entry[which]
            for i in range(tensor.shape[0]):
                seen = full.setdefault(name, {})
                if first + i in seen:
                    assert torch.equal(seen[first + i], tensor[i]), f"replicas of {name}[{first + i}] differ"
                seen[first + i] = tensor[i]
    return {name: torch.stack([e[i] for i in range(len(e))]) for name, e in full.items()}


def test_resume_at_the_same_layout_is_exact(results):
    steps = 2 * STEPS_PER_EPOCH
    for r in results:
        assert len(r["a"]["losses"]) == steps and len(r["b"]["losses"]) == STEPS_PER_EPOCH  # resumed at epoch 1
        assert r["b"]["losses"] == r["a"]["losses"][STEPS_PER_EPOCH:]
        for got, want in zip(r["b"]["params"], r["a"]["params"]):
            assert torch.equal(got, want)
    assert len(set(results[0]["a"]["losses"])) == steps  # the model changes: the comparison is not of constants


def test_reshard_ep4_to_ep2_loads_the_saved_experts_and_adam_state(results):
    saved = [r["a"]["saved"][STEPS_PER_EPOCH] for r in results]
    loaded = [r["c"]["started"] for r in results]
    for which in (1, 2):  # weights, then exp_avg
        want, got = _full(saved, which), _full(loaded, which)
        assert sorted(got) == sorted(want) and all(t.shape[0] == CONFIG["num_experts"] for t in got.values())
        for name in want:
            assert torch.equal(got[name], want[name]), name
    for r in results:  # and training goes on along A's loss curve (other all-to-all order: not bitwise)
        torch.testing.assert_close(torch.tensor(r["c"]["losses"]), torch.tensor(r["a"]["losses"][STEPS_PER_EPOCH:]))


def test_reshard_ep2_to_ep1_and_ep4_loads_the_saved_experts(results):
    saved = [r["c"]["saved"][2 * STEPS_PER_EPOCH] for r in results]
    for run in ("d", "e"):
        loaded = [r[run]["held"] for r in results]
        assert all(r[run]["losses"] == [] for r in results)  # fit restored the finished run and stopped
        for which in (1, 2):
            want, got = _full(saved, which), _full(loaded, which)
            for name in want:
                assert torch.equal(got[name], want[name]), (run, name)
    for r in results:  # ep=1: every rank holds all experts; ep=4: two of them
        assert all(first == 0 and t.shape[0] == CONFIG["num_experts"] for first, t, _ in r["d"]["held"].values())
        assert all(t.shape[0] == CONFIG["num_experts"] // 4 for _, t, _ in r["e"]["held"].values())
    validated = _full([r["validated"] for r in results], 1)  # `validate(ckpt_path=...)` at ep=2 loads them too
    assert all(torch.equal(validated[name], t) for name, t in _full(saved, 1).items())


def test_consolidated_export_loads_into_the_unsharded_model_with_the_same_outputs(results, root):
    unsharded = MoEGPT.load_from_checkpoint(root / "c_full.ckpt", map_location="cpu")
    unsharded.eval()
    with torch.no_grad():
        torch.testing.assert_close(unsharded(_probe()), results[0]["c"]["logits"])
    full = torch.load(root / "c_full.ckpt", weights_only=False)
    assert full["state_dict"].keys() == MoEGPT(**CONFIG).state_dict().keys()
    # the sharded checkpoint of the same state, consolidated offline in this process, is the same file content
    offline = torch.load(consolidate_checkpoint(root / "c" / EPOCH1, root / "offline.ckpt"), weights_only=False)
    for key, value in full["state_dict"].items():
        assert torch.equal(offline["state_dict"][key], value), key
    offline_state, full_state = offline["optimizer_states"][0]["state"], full["optimizer_states"][0]["state"]
    assert offline_state.keys() == full_state.keys()
    for index, entry in full_state.items():
        assert all(torch.equal(offline_state[index][k], v) for k, v in entry.items())


def test_consolidated_hf_export_loads_into_the_hf_model(results, root):
    hf = build_hf_model("qwen3_moe")
    state = load_consolidated_state_dict(root / "hf.ckpt", prefix="model.")
    assert state.keys() == hf.state_dict().keys()
    hf.load_state_dict(state, strict=True)
    hf.eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=_probe()).logits, results[0]["hf_logits"])


def test_checkpoint_with_another_expert_count_is_refused_on_every_rank(results):
    messages = {r["refused"] for r in results}
    assert len(messages) == 1
    message = messages.pop()
    assert "holds 8 experts for `layers.0.mlp.experts.gate_up_proj` but the model has 4" in message
    assert "Load it into a model built with 8 experts" in message


def test_a_sharded_checkpoint_loads_unsharded_in_one_process(results, root):
    """C's ep=2 checkpoint, read here with no process group into the plain model at ep=1 (weights and Adam)."""
    from lightning_moe_overlap.checkpoint import checkpointer
    from lightning_moe_overlap.moe.ep import apply_expert_parallel

    model = GPT(seed=4)
    apply_expert_parallel(model, None)
    opt = model.configure_optimizers()[0][0]
    loaded = checkpointer.load(root / "c" / EPOCH1, model, [opt], strict=True)
    checkpointer.load_module_state(model, loaded, strict=True)
    checkpointer.load_optimizer_states([opt], model, loaded)
    saved = [r["c"]["saved"][2 * STEPS_PER_EPOCH] for r in results]
    here = held_experts(model, opt)
    for which in (1, 2):
        want = _full(saved, which)
        assert all(torch.equal(here[name][which], t) for name, t in want.items())
    assert loaded["global_step"] == 2 * STEPS_PER_EPOCH
