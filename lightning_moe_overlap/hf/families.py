"""The key adapters this package knows, and the hook for a user's own.

Built in:

- ``hub_experts``: the Hub's per-expert keys ``...mlp.experts.N.{gate,up,down}_proj.weight``, as the published
  checkpoints of Qwen2-MoE, Qwen3-MoE, OLMoE and DeepSeek-V3 hold them (shared experts, routers and
  ``e_score_correction_bias`` keep the model's own names);
- ``mixtral``: Mixtral's ``...block_sparse_moe.experts.N.{w1,w3,w2}.weight`` (w1 = gate, w3 = up, w2 = down) and
  ``block_sparse_moe.gate.weight`` for the model's ``mlp.gate.weight``;
- ``identity``: every key is the model's own name (transformers v5's fused ``gate_up_proj`` / ``down_proj``).

A family is picked by ``config.json``'s ``model_type`` (user families first, newest first, then the built-in ones;
``identity`` where none lists it) or named explicitly (a family's name or a ``model_type``). Whatever the family,
a tensor whose own name is a key of the files loads from it, so a folder written with v5's fused keys loads too.
A new layout is one :func:`register_hf_family` call, at import time of the user's code (see :mod:`..registry`).
"""

from __future__ import annotations

from lightning_moe_overlap.hf.keys import HFFamily, hub_experts
from lightning_moe_overlap.registry import Registry

HUB_EXPERTS = HFFamily(
    name="hub_experts",
    model_types=("qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"),
    splits=hub_experts("gate_proj.weight", "up_proj.weight", "down_proj.weight"),
)
MIXTRAL = HFFamily(
    name="mixtral",
    model_types=("mixtral",),
    renames=((r"\.mlp\.", ".block_sparse_moe."),),
    splits=hub_experts("w1.weight", "w3.weight", "w2.weight"),
)
IDENTITY = HFFamily(name="identity")

HF_FAMILIES: Registry[HFFamily] = Registry(
    "key family", (HUB_EXPERTS, MIXTRAL, IDENTITY), ("register_hf_family", "unregister_hf_family")
)


def register_hf_family(family: HFFamily) -> HFFamily:
    """Add a key adapter for a family of checkpoints; it is picked for its ``model_types`` before the built-in
    families. Returns ``family``.

    Raises:
        TypeError: ``family`` is not an :class:`HFFamily`.
        ValueError: its name is taken.
    """
    if not isinstance(family, HFFamily):
        raise TypeError(
            f"`register_hf_family`: got {type(family).__name__}, not an `HFFamily`. Describe the layout as "
            "`HFFamily(name=..., model_types=(...), renames=(...), splits=(...))` (docs/hf_checkpoints.md)."
        )
    return HF_FAMILIES.add(family, fix="Unregister the old one first (`unregister_hf_family`) or pick another name.")


def unregister_hf_family(name: str) -> HFFamily:
    """Remove the user family called ``name`` (built-in families cannot be removed)."""
    return HF_FAMILIES.remove(name)


def select_family(family: str | HFFamily | None, model_type: str | None, owner: str) -> HFFamily:
    """The family to use: ``family`` itself, the one named (or listing the ``model_type``) ``family``, else the one
    listing ``model_type``, else ``identity``.

    Raises:
        ValueError: ``family`` is a string no family is named or lists as a model type.
    """
    if isinstance(family, HFFamily):
        return family
    ordered = (*reversed(HF_FAMILIES.user), *HF_FAMILIES.builtin)
    if family is not None:
        found = next((f for f in ordered if f.name == family), None) or _for_model_type(ordered, family)
        if found is None:
            raise ValueError(
                f"{owner}: family={family!r} is neither the name of a family nor a model_type one lists; families: "
                f"{HF_FAMILIES.names()}, model types: {sorted({t for f in ordered for t in f.model_types})}. Pass one "
                "of them, or register the layout with `register_hf_family` (docs/hf_checkpoints.md)."
            )
        return found
    return (_for_model_type(ordered, model_type) if model_type else None) or IDENTITY


def _for_model_type(families: tuple[HFFamily, ...], model_type: str) -> HFFamily | None:
    return next((f for f in families if model_type in f.model_types), None)
