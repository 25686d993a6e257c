"""A block-scaled FP8 DeepSeek-V3 checkpoint loaded on 2 gloo ranks: experts ``Shard(0)`` over a 1-D ep mesh (each
rank reads only its experts and their scales), dense FP8 weights sharded so that a rank's part starts inside a
128 x 128 block (rows and columns), the rest whole on both; and the folder as ``HFMoECausalLM(pretrained=...)``
under ``MoEOverlapStrategy(ep=2, shard="full")``, whose gathered state before the first step and first-step loss
are the oracle's.

Oracle: the files' weights dequantised by ``repeat_interleave`` of their scales (``tests/helpers/fp8_checkpoints.py``),
read by transformers' ``from_pretrained`` from a high-precision folder, cut with ``torch.chunk`` (what ``Shard(d)``
holds); its forward gives the loss (within 1e-5)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from tests.helpers.distributed import run_distributed
from tests.helpers.fp8_checkpoints import DEEPSEEK_FP8, expected_state, fp8_checkpoint
from tests.helpers.hf_checkpoints import tiny_model

SHARDED = {
    "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": 0,  # [68, 160]: rank 1 from row 34, inside block 0
    "model.layers.0.self_attn.q_a_proj.weight": 1,  # [64, 160]: rank 1 from column 80, across blocks 0 and 1
    "model.layers.0.mlp.gate_proj.weight": 0,  # [256, 160]: one row block each
}


MICRO, BATCH, SEQ, VOCAB = 2, 4, 6, 128


def _dim(name: str) -> int | None:
    return 0 if ".experts." in name else SHARDED.get(name)


def _load_rank(rank: int, world: int, path: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from lightning_moe_overlap.hf import load_hf_weights, module_tensors

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    held, shapes = module_tensors(tiny_model("deepseek_v3", seed=1, **DEEPSEEK_FP8))
    for name, tensor in held.items():
        dim = _dim(name)
        if dim is not None:
            local = torch.chunk(tensor.detach(), world, dim=dim)[rank].clone()
            held[name] = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=tensor.shape,
                                            stride=tensor.stride())  # fmt: skip
    report = load_hf_weights(held, shapes, path)
    local = {n: (t.to_local() if isinstance(t, DTensor) else t).detach().clone() for n, t in held.items()}
    return {"report": report, "local": local, "fit": _fit(path)}


def _fit(path: str) -> dict:
    """The strategy's gathered state before the first step (rank 0), that step's batch and loss."""
    from lightning.pytorch import Callback, Trainer
    from torch.utils.data import DataLoader

    from lightning_moe_overlap import MoEOverlapStrategy
    from lightning_moe_overlap.demo_hf import HFMoECausalLM

    out: dict = {}

    class FirstStep(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            state = trainer.strategy.full_state_dict()  # collective; rank 0 gets it (live buffers: cloned)
            out["state"] = None if state is None else {k: v.clone() for k, v in state.items()}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            out["batch"], out["loss"] = batch.clone(), float(outputs["loss"])

    torch.manual_seed(11)  # the random init the load must overwrite
    model = HFMoECausalLM(pretrained=path, lr=1e-2)
    data = torch.randint(0, VOCAB, (16, SEQ), generator=torch.Generator().manual_seed(5))
    model.train_dataloader = lambda: DataLoader(data, batch_size=BATCH)
    trainer = Trainer(
        accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[FirstStep()],
        strategy=MoEOverlapStrategy(ep=2, num_microbatches=MICRO, shard="full"),
    )  # fmt: skip
    trainer.fit(model)
    return out


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("fp8")
    _, files = fp8_checkpoint(root / "fp8")
    oracle = root / "oracle"
    oracle.mkdir()
    config = json.loads((root / "fp8" / "config.json").read_text())
    del config["quantization_config"]
    (oracle / "config.json").write_text(json.dumps(config))
    save_file(expected_state(files, (128, 128)), str(oracle / "model.safetensors"), metadata={"format": "pt"})
    reference = AutoModelForCausalLM.from_pretrained(oracle, dtype=torch.float32).eval()
    return reference, run_distributed(_load_rank, 2, str(root / "fp8"), timeout_s=300)


def test_each_rank_holds_the_oracles_slice_and_reads_only_its_experts_scales(loaded):
    reference, results = loaded
    expected = reference.state_dict()
    for rank, result in enumerate(results):
        for name, value in expected.items():
            dim = _dim(name)
            want = value if dim is None else torch.chunk(value, 2, dim=dim)[rank]
            assert torch.equal(result["local"][name], want), (rank, name)
        scales = [k for k in result["report"].keys if ".experts." in k and k.endswith("_scale_inv")]
        numbers = {int(k.split(".experts.")[1].split(".")[0]) for k in scales}
        assert numbers == set(range(rank * 4, rank * 4 + 4)) and len(scales) == 3 * 4, (rank, scales)


def test_the_strategy_loads_the_fp8_folder_sharded_and_its_first_loss_is_the_oracles(loaded):
    reference, results = loaded
    expected = {f"model.{k}": v for k, v in reference.state_dict().items()}
    state = results[0]["fit"]["state"]
    assert state.keys() == expected.keys() and not [k for k in expected if not torch.equal(state[k], expected[k])]
    for rank, result in enumerate(results):
        with torch.no_grad():
            loss = torch.stack([reference(input_ids=p, labels=p).loss for p in result["fit"]["batch"].chunk(MICRO)])
        assert abs(result["fit"]["loss"] - float(loss.mean())) <= 1e-5, (rank, result["fit"]["loss"], loss)
