"""``configure_model`` on the meta device at every pp: each rank allocates only what it holds (gloo, CPU).

Oracle: the model built with real tensors in one process, ``seeded_init(model, seed, model.init_module)`` applied,
its full state dict. Runs:
- 2 ranks, ``ep=2``: ``MoEGPT`` and HF Qwen3-MoE built in ``configure_model`` (the HF one from a ``config.json``
  folder, ``pretrained``): each rank's held tensors (``strategy.held_tensors()``) equal the oracle's, its experts the
  oracle's rows of its ep rank; the bytes it holds are the dense bytes plus ``1/ep`` of the experts'; a 2-step fit
  has the first-step loss of the same fit of the model built in ``__init__`` with the oracle's values (1e-6), which
  also shows a model built in ``__init__`` keeps its values. (With ``hf_weights`` the experts are allocated and not
  initialised: tests/unit/test_materialize.py; the load that fills them: test_hf_pretrained.py.)
- 4 ranks, ``pp=2 x ep=2`` (dp=2): ``MoEGPT`` built in ``configure_model``: each rank holds its chunk's tensors
  equal to the oracle's (experts: its rows), the other chunk's on meta, and ``global_shapes()`` is the oracle's.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap.demo import MoEGPT, SyntheticTokens
from lightning_moe_overlap.parallel.dtensors import local
from lightning_moe_overlap.pipeline.split import seeded_init
from tests.helpers.distributed import run_distributed

transformers = pytest.importorskip("transformers", reason="Requires: transformers>=5")

SEED, EP, M, B, STEPS = 0, 2, 2, 4, 2
GPT = dict(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, num_experts=4, top_k=2, ffn_hidden_size=8,
           shared_expert_ffn_hidden_size=8)  # fmt: skip
GPT_DATA = dict(vocab_size=32, seq_len=6, batch_size=B, num_samples=32)
HF_DATA = dict(vocab_size=128, seq_len=6, batch_size=B, num_samples=32)


class ConfiguredGPT(MoEGPT):
    """``MoEGPT`` whose modules are built in ``configure_model`` (under the strategy's meta device)."""

    def __init__(self) -> None:
        LightningModule.__init__(self)
        self.save_hyperparameters({"lr": 3e-3})

    def configure_model(self) -> None:
        if not hasattr(self, "layers"):
            built = MoEGPT(**GPT)
            for name, child in built.named_children():
                setattr(self, name, child)
            self.pipeline_num_layers = built.pipeline_num_layers


def _gpt_oracle() -> MoEGPT:
    model = MoEGPT(**GPT)
    seeded_init(model, SEED, model.init_module)
    return model


def _hf_oracle():
    from lightning_moe_overlap.demo_hf import HFMoECausalLM

    model = HFMoECausalLM("qwen3_moe")
    seeded_init(model, SEED, model.init_module)
    return model


def _configured_hf(folder: str):
    from lightning_moe_overlap.demo_hf import HFMoECausalLM

    model = HFMoECausalLM(pretrained=folder)
    model.hf_weights = None  # built from the folder's config.json, nothing loaded: the seeded init everywhere
    return model


class Capture(Callback):
    """What the rank holds once the strategy is set up, and the loss of each step."""

    def __init__(self) -> None:
        self.held: dict[str, torch.Tensor] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.bytes = 0
        self.meta: list[str] = []
        self.losses: list[float] = []

    def on_fit_start(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        self.held = {k: local(v).detach().clone() for k, v in strategy.held_tensors().items()}
        self.shapes = strategy.global_shapes()
        tensors = {id(t): t for t in [*pl_module.parameters(), *pl_module.buffers()]}.values()
        self.bytes = sum(local(t).numel() * t.element_size() for t in tensors if not t.is_meta)
        self.meta = sorted(n for n, p in pl_module.named_parameters() if p.is_meta)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def _fit(model: LightningModule, data: dict, world: int, steps: int, **strategy) -> dict:
    seed_everything(SEED)
    capture = Capture()
    trainer = Trainer(
        accelerator="cpu", devices=world, strategy=MoEOverlapStrategy(num_microbatches=M, timeout=120, **strategy),
        max_steps=steps, limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[capture],
    )  # fmt: skip
    trainer.fit(model, datamodule=SyntheticTokens(**data))
    coords = trainer.strategy.dims.coords(trainer.global_rank)
    return {"ep": coords.ep, "pp": coords.pp, "held": capture.held, "shapes": capture.shapes,
            "bytes": capture.bytes, "meta": capture.meta, "losses": capture.losses}  # fmt: skip


def worker_ep(rank: int, world: int, folder: str) -> dict:
    torch.use_deterministic_algorithms(True)
    seed_everything(SEED)
    real_gpt = _gpt_oracle()
    seed_everything(SEED)
    real_hf = _hf_oracle()
    return {
        "gpt-meta": _fit(ConfiguredGPT(), GPT_DATA, world, STEPS, ep=EP),
        "gpt-real": _fit(real_gpt, GPT_DATA, world, STEPS, ep=EP),
        "hf-meta": _fit(_configured_hf(folder), HF_DATA, world, STEPS, ep=EP),
        "hf-real": _fit(real_hf, HF_DATA, world, STEPS, ep=EP),
    }


def worker_pp(rank: int, world: int) -> dict:
    return _fit(ConfiguredGPT(), GPT_DATA, world, 0, ep=EP, pp=2, vpp=1, pipeline_schedule="1f1b")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    from lightning_moe_overlap.demo_hf import build_hf_model

    path = tmp_path_factory.mktemp("pretrained")
    build_hf_model("qwen3_moe").config.save_pretrained(path)  # config.json only: the weights come later
    return str(path)


@pytest.fixture(scope="module")
def ep_results(folder: str) -> list[dict]:
    return run_distributed(worker_ep, 2, folder, timeout_s=300)


@pytest.fixture(scope="module")
def pp_results() -> list[dict]:
    return run_distributed(worker_pp, 4, timeout_s=300)


def _is_expert(name: str) -> bool:
    return ".experts." in name and name.endswith(("gate_up_proj", "down_proj"))


def _rows(value: torch.Tensor, ep_rank: int) -> torch.Tensor:
    per = value.shape[0] // EP
    return value[ep_rank * per : (ep_rank + 1) * per]


def _check_held(run: dict, oracle: dict[str, torch.Tensor]) -> None:
    for name, value in run["held"].items():
        expected = _rows(oracle[name], run["ep"]) if _is_expert(name) else oracle[name]
        assert value.shape == expected.shape, name  # experts: only this rank's rows exist here
        assert torch.equal(value, expected), name


def _expected_bytes(model: torch.nn.Module, names: set[str] | None = None) -> int:
    total = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if names is None or name in names:
            total += t.numel() * t.element_size() // (EP if _is_expert(name) else 1)
    return total


@pytest.mark.parametrize("kind", ["gpt", "hf"])
def test_each_rank_holds_the_oracle_values_and_only_its_experts(ep_results, kind):
    oracle = (_gpt_oracle if kind == "gpt" else _hf_oracle)()
    state = oracle.state_dict()
    for rank in ep_results:
        for run in (rank[f"{kind}-meta"], rank[f"{kind}-real"]):
            assert run["held"].keys() == state.keys()
            _check_held(run, state)
            assert run["shapes"] == {k: tuple(v.shape) for k, v in state.items()}
            assert run["bytes"] == _expected_bytes(oracle)
    assert {rank[f"{kind}-meta"]["ep"] for rank in ep_results} == {0, 1}


@pytest.mark.parametrize("kind", ["gpt", "hf"])
def test_a_fit_of_the_meta_build_matches_the_build_with_values(ep_results, kind):
    for rank in ep_results:
        meta, real = rank[f"{kind}-meta"]["losses"], rank[f"{kind}-real"]["losses"]
        assert len(meta) == len(real) == STEPS
        assert abs(meta[0] - real[0]) <= 1e-6, (meta, real)



def test_at_pp2_each_rank_holds_its_chunk_and_its_experts(pp_results):
    oracle = _gpt_oracle()
    state = oracle.state_dict()
    chunks = {0: ("embed.", "layers.0."), 1: ("layers.1.", "norm.", "head.")}
    for run in pp_results:
        own = chunks[run["pp"]]
        assert run["held"] and all(k.startswith(own) for k in run["held"])
        assert run["held"].keys() == {k for k in state if k.startswith(own)}
        _check_held(run, state)
        assert run["meta"] and not any(n.startswith(own) for n in run["meta"])
        assert run["shapes"] == {k: tuple(v.shape) for k, v in state.items()}
        assert run["bytes"] == _expected_bytes(oracle, {k for k, _ in oracle.named_parameters() if k.startswith(own)}
                                               | {k for k, _ in oracle.named_buffers() if k.startswith(own)})
    assert sorted((r["pp"], r["ep"]) for r in pp_results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
