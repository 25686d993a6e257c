"""Key families as data: the pieces of a fused tensor, the choice of family, the registration hook, and the cover
check, against boxes written out by hand (the Hub layout as ``save_pretrained`` writes it)."""

from __future__ import annotations

import pytest
import torch

from lightning_moe_overlap.hf import HF_FAMILIES, HFFamily, HFKeysError, Piece, Split, register_hf_family
from lightning_moe_overlap.hf import unregister_hf_family
from lightning_moe_overlap.hf.key_match import covers, group_keys, plan_pieces
from lightning_moe_overlap.hf.families import HUB_EXPERTS, IDENTITY, MIXTRAL, select_family
from lightning_moe_overlap.hf.files import FileTensor


@pytest.fixture(autouse=True)
def _scoped():
    with HF_FAMILIES.scoped():
        yield


def test_hub_experts_cut_gate_up_per_expert_and_in_halves():
    pieces = HUB_EXPERTS.pieces("model.layers.3.mlp.experts.gate_up_proj", (2, 8, 5))
    assert pieces == [
        Piece("model.layers.3.mlp.experts.0.gate_proj.weight", (0, (0, 4), (0, 5))),
        Piece("model.layers.3.mlp.experts.0.up_proj.weight", (0, (4, 8), (0, 5))),
        Piece("model.layers.3.mlp.experts.1.gate_proj.weight", (1, (0, 4), (0, 5))),
        Piece("model.layers.3.mlp.experts.1.up_proj.weight", (1, (4, 8), (0, 5))),
    ]
    assert pieces[0].shape == (4, 5)
    down = HUB_EXPERTS.pieces("model.layers.3.mlp.experts.down_proj", (2, 5, 4))
    assert [p.key for p in down] == [f"model.layers.3.mlp.experts.{e}.down_proj.weight" for e in (0, 1)]
    assert HUB_EXPERTS.pieces("model.layers.3.mlp.shared_experts.gate_proj.weight", (4, 5)) == [
        Piece("model.layers.3.mlp.shared_experts.gate_proj.weight", ((0, 4), (0, 5)))
    ]


def test_mixtral_renames_the_block_and_names_w1_w3_w2():
    assert MIXTRAL.pieces("model.layers.0.mlp.gate.weight", (4, 8)) == [
        Piece("model.layers.0.block_sparse_moe.gate.weight", ((0, 4), (0, 8)))
    ]
    keys = [p.key for p in MIXTRAL.pieces("model.layers.0.mlp.experts.gate_up_proj", (1, 6, 8))]
    stem = "model.layers.0.block_sparse_moe.experts.0"
    assert keys == [f"{stem}.w1.weight", f"{stem}.w3.weight"]
    assert MIXTRAL.pieces("model.layers.0.mlp.experts.down_proj", (1, 8, 3))[0].key.endswith("experts.0.w2.weight")
    assert MIXTRAL.pieces("model.layers.0.mlp.experts.gate_up_proj", (1, 5, 8)) is None  # odd: cannot halve


def test_a_family_is_picked_by_model_type_or_name():
    assert select_family(None, "qwen3_moe", "t") is HUB_EXPERTS
    assert select_family(None, "mixtral", "t") is MIXTRAL
    assert select_family(None, "llama", "t") is IDENTITY and select_family(None, None, "t") is IDENTITY
    assert select_family("deepseek_v3", None, "t") is HUB_EXPERTS
    assert select_family("identity", "mixtral", "t") is IDENTITY
    with pytest.raises(ValueError, match=r"t: family='nope' is neither the name of a family nor a model_type"):
        select_family("nope", None, "t")


def test_a_registered_family_is_picked_before_the_built_in_ones_and_can_be_removed():
    mine = HFFamily(
        name="mine", model_types=("qwen3_moe",), renames=((r"^model\.", "transformer."),),
        splits=(Split(r"(?P<s>.+)\.fused", ("{s}.a", "{s}.b"), dim=0),),
    )  # fmt: skip
    register_hf_family(mine)
    assert select_family(None, "qwen3_moe", "t") is mine
    assert [p.key for p in mine.pieces("model.x.fused", (4, 2))] == ["transformer.x.a", "transformer.x.b"]
    with pytest.raises(ValueError, match=r"`register_hf_family`: a key family named 'mine' is already registered"):
        register_hf_family(mine)
    with pytest.raises(TypeError, match=r"got dict, not an `HFFamily`"):
        register_hf_family({"name": "x"})
    unregister_hf_family("mine")
    assert select_family(None, "qwen3_moe", "t") is HUB_EXPERTS
    with pytest.raises(ValueError, match=r"no user key family named 'hub_experts'"):
        unregister_hf_family("hub_experts")


def test_covers_needs_every_element_exactly_once():
    full = [Piece("a", (0, (0, 4))), Piece("b", (1, (0, 4)))]
    assert covers(full, (2, 4))
    assert not covers(full[:1], (2, 4))  # expert 1 not covered
    assert not covers([*full, Piece("c", (1, (2, 3)))], (2, 4))  # overlap
    assert not covers([Piece("a", ((0, 5),))], (4,))  # outside


def test_a_family_whose_pieces_leave_a_gap_is_named():
    gap = HFFamily(name="gap", splits=(Split(r"w", ("{e}.w",)),))  # per expert, one file tensor each: fine
    files = {f"{e}.w": FileTensor("f", (3,), torch.float32) for e in range(2)}
    assert len(plan_pieces({"w": (2, 3)}, files, gap, tied=False, where="here", owner="t")["w"]) == 2
    broken = HFFamily(name="broken", splits=(Split(r"w", ("{e}.w", "{e}.v"), dim=0),))  # dim 0 is the experts'
    files = {f"{e}.{k}": FileTensor("f", (1, 3), torch.float32) for e in range(2) for k in "wv"}
    with pytest.raises(HFKeysError, match=r"pieces do not cover exactly once \(1\):\n    w \[2, 3\]"):
        plan_pieces({"w": (2, 3)}, files, broken, tied=False, where="here", owner="t")


def test_keys_are_grouped_by_their_last_number():
    keys = [f"m.layers.0.experts.{e}.w1.weight" for e in (3, 5, 6, 7)] + ["m.norm.weight", "m.layers.2.x"]
    assert group_keys(keys) == ["m.layers.0.experts.{3,5-7}.w1.weight", "m.layers.{2}.x", "m.norm.weight"]
