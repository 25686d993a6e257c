"""Checkpoints across pipeline layouts on 4 gloo ranks, at checkpointer level, every check in one spawn.

The source is a 4-layer ``MoEGPT`` after 2 AdamW steps in one process (model and optimizer state). A layout holds it
as the strategy does at pp > 1 (docs/pipeline.md): the unsplit model with the other pp ranks' chunks on meta and
expert parallelism applied to the held chunks, its tensors and AdamW state cut from the source by hand (the oracle).

- pp=2 x ep=2 (vpp=2, interleaved chunks; its optimizer lists only held parameters) saves sharded and consolidated:
  the DCP metadata has every key of the unsplit model with its global shape, each chunk written once, and the
  consolidated file is the source's own ``state_dict()`` / ``optimizer.state_dict()``, loadable into the plain
  model, and equal to the offline consolidation of the sharded directory;
- both load at pp=1 x ep=2 and pp=1 x ep=1, strictly: every held tensor and AdamW state is ``torch.equal`` to the
  source's, on every rank;
- the reverse: pp=1 x ep=2 saves, and both formats load at pp=2 x ep=2 (V placement, an optimizer listing every
  parameter; interleaved, held parameters only); tensors on meta stay on meta and get no optimizer state;
- the same code with FSDP2: the test ``fully_shard`` s the model over the 4 ranks (every parameter a ``DTensor``),
  saves after an AdamW step, loads into another FSDP2 model bitwise, and the test's own process loads the
  directory into the plain model: every tensor and AdamW state is the gathered one.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from lightning_moe_overlap.checkpoint import checkpointer, consolidate_checkpoint
from lightning_moe_overlap.demo import MoEGPT
from lightning_moe_overlap.moe.ep import apply_expert_parallel
from lightning_moe_overlap.moe.ep import ExpertParallelExperts
from lightning_moe_overlap.parallel import ParallelDims
from lightning_moe_overlap.config.pipeline_layout import build_layout
from lightning_moe_overlap.pipeline.split import split_model
from tests.helpers.distributed import mesh_groups, run_distributed

WORLD, E, LAYERS = 4, 4, 4
CONFIG = dict(vocab_size=16, hidden_size=8, num_layers=LAYERS, num_heads=2, num_experts=E, top_k=2, ffn_hidden_size=4)


def source() -> tuple[dict, dict, dict]:
    """The unsplit model after 2 AdamW steps: (state_dict, {param name: AdamW state}, optimizer.state_dict()).

    The gradients are seeded noise (no forward pass: the checkpoint code only sees the resulting state).
    """
    model = MoEGPT(**CONFIG, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    by_name = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    return {k: v.clone() for k, v in model.state_dict().items()}, by_name, opt.state_dict()


def build(groups, *, vpp: int = 1, placement: str = "interleaved", held_only: bool = False):
    """A layout of the model (other values than the source's): meta for other pp ranks' chunks, ep on held ones."""
    model = MoEGPT(**CONFIG, seed=1)
    if groups.dims.pp == 1:
        apply_expert_parallel(model, groups.ep)
    else:
        split = split_model(model, build_layout(LAYERS, groups.dims.pp, vpp, placement=placement))
        mine = split.chunk_indices_of_rank(groups.coords.pp)
        for c, chunk in enumerate(split.chunks):
            if c not in mine:
                chunk.to("meta")
        for c in mine:
            apply_expert_parallel(split.chunks[c], groups.ep)
    params = [p for p in model.parameters() if not (held_only and p.is_meta)]
    return model, torch.optim.AdamW(params, lr=1e-2)


def cut(model) -> callable:
    """``cut(name, full)``: this rank's part of the source's tensor ``name`` (its experts along dim 0)."""
    shards = {
        f"{prefix}.{name}": child.expert_shard
        for prefix, child in model.named_modules()
        if isinstance(child, ExpertParallelExperts)
        for name, _ in [*child.named_parameters(recurse=False), *child.named_buffers(recurse=False)]
    }

    def part(name: str, full: torch.Tensor) -> torch.Tensor:
        shard = shards.get(name)
        if shard is None or full.dim() == 0:
            return full
        return full[shard.first_expert : shard.first_expert + shard.num_local]

    return part


def fill(model, opt, ref) -> None:
    state, adam, _ = ref
    part = cut(model)
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if not tensor.is_meta:
                tensor.copy_(part(name, state[name]))
    listed = {id(p) for g in opt.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        if not p.is_meta and id(p) in listed:
            opt.state[p] = {k: part(name, v).clone() for k, v in adam[name].items()}


def differences(model, opt, ref, where: str) -> list[str]:
    """Every held tensor and its AdamW state against the source's part; meta stays meta, without state."""
    state, adam, _ = ref
    part, out, held = cut(model), [], 0
    for name, tensor in model.state_dict().items():
        if tensor.is_meta:
            continue
        held += 1
        if not torch.equal(tensor, part(name, state[name])):
            out.append(f"{where}: {name} differs")
    for name, p in model.named_parameters():
        if p.is_meta:
            if p in opt.state:
                out.append(f"{where}: meta {name} got optimizer state")
            continue
        got, want = opt.state.get(p, {}), adam[name]
        same = got.keys() == want.keys() and all(torch.equal(got[k], part(name, v)) for k, v in want.items())
        if not same:
            out.append(f"{where}: AdamW state of {name} differs")
    if held == 0:
        out.append(f"{where}: holds nothing")
    return out


def load_into(path: Path, groups, rank: int, ref, where: str, **layout) -> list[str]:
    model, opt = build(groups, **layout)
    loaded = checkpointer.load(path, model, [opt], strict=True)
    checkpointer.load_module_state(model, loaded, strict=True)
    checkpointer.load_optimizer_states([opt], model, loaded)
    return differences(model, opt, ref, f"rank {rank} {where}")


def save_both(root: Path, name: str, groups, rank: int, ref, **layout) -> None:
    model, opt = build(groups, **layout)
    fill(model, opt, ref)
    checkpoint = {
        "epoch": 1,
        "global_step": 2,
        "state_dict": checkpointer.module_state(model),
        "optimizer_states": [checkpointer.optimizer_state(opt, model)],
    }
    assert not any(v.is_meta for v in checkpoint["state_dict"].values())
    checkpointer.save(checkpoint, root / name, "sharded", model, [opt], groups)
    checkpointer.save(checkpoint, root / f"{name}.ckpt", "consolidated", model, [opt], groups)


def check_files(root: Path, name: str, ref) -> list[str]:
    """Rank 0: the sharded directory's keys and the consolidated file against the source."""
    import torch.distributed.checkpoint as dcp

    state, _, optim = ref
    problems = []
    expected = set(state)  # the unsplit model's own names, experts with their global shape
    metadata = dcp.FileSystemReader(root / name).read_metadata()
    saved = {k[len("model.") :]: m.size for k, m in metadata.state_dict_metadata.items() if k.startswith("model.")}
    if set(saved) != expected or any(tuple(saved[k]) != tuple(v.shape) for k, v in state.items()):
        problems.append(f"{name}: keys {sorted(set(saved) ^ expected)[:4]} or shapes differ from the unsplit model's")
    written = [(i.fqn, tuple(i.offset)) for i in metadata.storage_data if i.fqn.startswith("model.")]
    if sorted(written) != sorted(set(written)):
        problems.append(f"{name}: some chunks were written more than once")
    offline = torch.load(consolidate_checkpoint(root / name, root / f"{name}.offline"), weights_only=False)
    for label, full in (("consolidated", torch.load(root / f"{name}.ckpt", weights_only=False)), ("offline", offline)):
        got_state = full["state_dict"]
        if list(got_state) != list(state) or not all(torch.equal(got_state[k], v) for k, v in state.items()):
            problems.append(f"{name} {label}: state_dict is not the unsplit model's")
        got = full["optimizer_states"][0]
        if got["param_groups"] != optim["param_groups"] or got["state"].keys() != optim["state"].keys():
            problems.append(f"{name} {label}: optimizer layout is not the unsplit optimizer's")
        for i, entry in optim["state"].items():
            if not all(torch.equal(got["state"][i][k], v) for k, v in entry.items()):
                problems.append(f"{name} {label}: optimizer state {i} differs")
    plain = MoEGPT(**CONFIG, seed=2)
    full = torch.load(root / f"{name}.ckpt", weights_only=False)
    plain.load_state_dict(full["state_dict"], strict=True)
    torch.optim.AdamW(plain.parameters(), lr=1e-2).load_state_dict(full["optimizer_states"][0])
    return problems


def fsdp_model(seed: int, world_size: int):
    """``MoEGPT`` (ep=1) with ``fully_shard`` on each layer and the root over every rank, and its AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = MoEGPT(**CONFIG, seed=seed)
    apply_expert_parallel(model, None)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def fsdp_case(root: Path, rank: int, world_size: int) -> list[str]:
    """Save a stepped FSDP2 model sharded; load it into another; rank 0 keeps the gathered state (the oracle)."""
    model, opt = fsdp_model(0, world_size)
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(rank))
    model(tokens).square().mean().backward()
    opt.step()
    checkpoint = {
        "state_dict": checkpointer.module_state(model),
        "optimizer_states": [checkpointer.optimizer_state(opt, model)],
    }
    checkpointer.save(checkpoint, root / "fsdp", "sharded", model, [opt], None)
    other, other_opt = fsdp_model(1, world_size)
    loaded = checkpointer.load(root / "fsdp", other, [other_opt], strict=True)
    checkpointer.load_module_state(other, loaded, strict=True)
    checkpointer.load_optimizer_states([other_opt], other, loaded)
    problems = []
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        if not torch.equal(p.to_local(), q.to_local()):
            problems.append(f"rank {rank} fsdp: {name} differs")
        for k, v in opt.state[p].items():
            w = other_opt.state[q][k]
            if not torch.equal(_local(v), _local(w)):
                problems.append(f"rank {rank} fsdp: AdamW {k} of {name} differs")
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    adam = {n: {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in opt.state[p].items()}
            for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"params": full, "adam": adam}, root / "fsdp_gathered.pt")
    return problems


def worker(rank: int, world_size: int, root: str) -> list[str]:
    torch.use_deterministic_algorithms(True)
    root = Path(root)
    ref = source()
    pp2 = mesh_groups(ParallelDims.from_world_size(world_size, pp=2, ep=2), rank)
    pp1 = mesh_groups(ParallelDims.from_world_size(world_size, ep=2), rank)
    pp1_ep1 = mesh_groups(ParallelDims.from_world_size(world_size), rank)
    problems: list[str] = []
    save_both(root, "pp2", pp2, rank, ref, vpp=2, held_only=True)
    if rank == 0:
        problems += check_files(root, "pp2", ref)
    for fmt in ("pp2", "pp2.ckpt"):
        problems += load_into(root / fmt, pp1, rank, ref, f"{fmt} -> pp1 ep2")
        problems += load_into(root / fmt, pp1_ep1, rank, ref, f"{fmt} -> pp1 ep1")
    save_both(root, "pp1", pp1, rank, ref)
    for fmt in ("pp1", "pp1.ckpt"):
        problems += load_into(root / fmt, pp2, rank, ref, f"{fmt} -> pp2 v", vpp=2, placement="v")
        problems += load_into(root / fmt, pp2, rank, ref, f"{fmt} -> pp2 held-only", vpp=1, held_only=True)
    problems += fsdp_case(root, rank, world_size)
    return problems


def test_checkpoints_load_across_pipeline_layouts_and_fsdp(tmp_path):
    results = run_distributed(worker, WORLD, str(tmp_path), timeout_s=120.0)
    assert [p for rank in results for p in rank] == []
    gathered = torch.load(tmp_path / "fsdp_gathered.pt", weights_only=False)
    model = MoEGPT(**CONFIG, seed=5)  # unsharded, one process, no process group
    apply_expert_parallel(model, None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loaded = checkpointer.load(tmp_path / "fsdp", model, [opt], strict=True)
    checkpointer.load_module_state(model, loaded, strict=True)
    checkpointer.load_optimizer_states([opt], model, loaded)
    for name, p in model.named_parameters():
        assert torch.equal(p, gathered["params"][name]), name
        assert all(torch.equal(opt.state[p][k], v) for k, v in gathered["adam"][name].items()), name
