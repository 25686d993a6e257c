"""``load_hf_weights`` on 2 gloo ranks: experts as ``DTensor``s ``Shard(0)`` over a 1-D ep mesh, each rank reading
only its experts; the embedding and head sharded unevenly as ``fully_shard`` cuts them (``Shard(0)`` on the same
mesh); the rest whole on both.

Oracle: the state dict of the model ``save_pretrained`` wrote, cut with ``torch.chunk`` (what ``Shard(0)`` holds)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tests.helpers.distributed import run_distributed
from tests.helpers.hf_checkpoints import tiny_model

SHARDED_DENSE = ("model.embed_tokens.weight", "lm_head.weight")  # 129 rows: 65 on rank 0, 64 on rank 1


def _held(rank: int, world: int, model_type: str) -> tuple[dict, dict, dict]:
    """``(held, shapes, local chunks as plain tensors)`` of a model with other weights than the files'."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from lightning_moe_overlap.hf import module_tensors

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    held, shapes = module_tensors(tiny_model(model_type, seed=1, vocab_size=129))
    out = {}
    for name, tensor in held.items():
        if ".experts." in name or name in SHARDED_DENSE:
            local = torch.chunk(tensor.detach(), world, dim=0)[rank].clone()
            out[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=tensor.shape,
                                           stride=tensor.stride())
        else:
            out[name] = tensor.detach()
    return out, shapes, mesh


def _load_rank(rank: int, world: int, folders: dict[str, str], broken: str) -> dict:
    """Load each family's folder; then the folder with a missing expert (its error message comes back)."""
    from torch.distributed.tensor import DTensor

    from lightning_moe_overlap.hf import HFKeysError, load_hf_weights

    out: dict = {}
    for model_type, path in folders.items():
        held, shapes, _ = _held(rank, world, model_type)
        report = load_hf_weights(held, shapes, path)
        local = {n: (t.to_local() if isinstance(t, DTensor) else t).clone() for n, t in held.items()}
        out[model_type] = {"report": report, "local": local}
    held, shapes, _ = _held(rank, world, "qwen3_moe")  # expert 1 (missing) is rank 0's; both ranks fail alike
    try:
        load_hf_weights(held, shapes, broken)
    except HFKeysError as err:
        out["error"] = str(err)
    return out


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """Both families written by ``save_pretrained``, loaded on 2 ranks (one launch for every test here)."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("hf")
    sources, folders = {}, {}
    for model_type in ("qwen3_moe", "mixtral"):
        sources[model_type] = tiny_model(model_type, seed=0, vocab_size=129)
        folders[model_type] = str(root / model_type)
        sources[model_type].save_pretrained(folders[model_type])
    broken = root / "broken"
    tiny_model("qwen3_moe", seed=0, vocab_size=129).save_pretrained(broken)
    files = load_file(broken / "model.safetensors")
    del files["model.layers.0.mlp.experts.1.down_proj.weight"]
    save_file(files, str(broken / "model.safetensors"), metadata={"format": "pt"})
    return sources, run_distributed(_load_rank, 2, folders, str(broken), timeout_s=180)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_each_rank_reads_only_its_experts_and_gets_the_files_values(loaded, model_type):
    sources, results = loaded
    source = sources[model_type]
    expected = source.state_dict()
    experts = source.config.num_local_experts if model_type == "mixtral" else source.config.num_experts
    per_rank = experts // 2
    for rank, result in enumerate(r[model_type] for r in results):
        report, local = result["report"], result["local"]
        for name, value in expected.items():
            want = torch.chunk(value, 2, dim=0)[rank] if _sharded(name) else value
            assert torch.equal(local[name], want), (rank, name)
        expert_keys = [k for k in report.keys if ".experts." in k]
        numbers = {int(k.split(".experts.")[1].split(".")[0]) for k in expert_keys}
        assert numbers == set(range(rank * per_rank, (rank + 1) * per_rank)), (rank, numbers)
        assert len(expert_keys) == 2 * 3 * per_rank  # 2 layers x (gate, up, down) x its experts
        held_bytes = sum(t.numel() * 4 for t in local.values())
        assert report.bytes_read == held_bytes, (rank, report.bytes_read, held_bytes)  # fp32 files, nothing twice
    # the sharded tensors are read once across the ranks, the others once per rank
    both = sum(r[model_type]["report"].bytes_read for r in results)
    assert both == sum(v.numel() * 4 * (1 if _sharded(n) else 2) for n, v in expected.items())


def test_a_missing_expert_fails_on_every_rank_with_its_name(loaded):
    _, results = loaded
    for result in results:
        text = result.get("error", "")
        assert "model.layers.0.mlp.experts.{1}.down_proj.weight" in text and "missing keys (1;" in text, text


def _sharded(name: str) -> bool:
    return ".experts." in name or name in SHARDED_DENSE
