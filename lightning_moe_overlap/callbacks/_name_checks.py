"""Checks and error messages shared by the memory callbacks: the values, the rule, the fix."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn


def check_names(owner: str, arg: str, names: object, valid: Sequence[str], *, required: bool = True) -> tuple[str, ...]:
    """``names`` as a tuple without duplicates, after checking it is a list of valid names.

    Raises:
        TypeError: not a list/tuple of strings (a single string included).
        ValueError: empty (when ``required``) or holding names outside ``valid``.
    """
    if names is None:
        names = []
    if isinstance(names, str) or not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"{owner}: {arg}={names!r} must be a list of names, e.g. {arg}=[{valid[0]!r}]. Valid names: {list(valid)}."
        )
    if required and not names:
        raise ValueError(f"{owner}: {arg} is empty; list at least one of {list(valid)}.")
    unknown = [n for n in names if n not in valid]
    if unknown:
        raise ValueError(
            f"{owner}: {arg} has unknown name(s) {unknown}; the valid names are {list(valid)}. Fix the spelling, or "
            "map a new name onto your layer with `register_layer_names` (docs/memory.md)."
        )
    return tuple(dict.fromkeys(names))


def describe(model: nn.Module | Sequence[nn.Module]) -> str:
    """``MoEGPT`` for a model, ``chunks [GPTChunk, GPTChunk]`` for a list of pipeline chunks."""
    if isinstance(model, nn.Module):
        return type(model).__name__
    return f"chunks {[type(m).__name__ for m in model]}"


def no_layers_error(owner: str, model: nn.Module | Sequence[nn.Module]) -> ValueError:
    """No layer of ``model`` (or of any of its chunks) is recognised by a spec."""
    return ValueError(
        f"{owner}: no decoder layer recognised in {describe(model)}; the built-in specs know this package's "
        "layers (attn_norm, attn, mlp_norm, mlp) and HF v5 pre-norm layers (input_layernorm, self_attn, "
        "post_attention_layernorm, mlp). Register your layer with `register_layer_names` (docs/memory.md)."
    )


def missing_names_error(
    owner: str,
    arg: str,
    missing: Sequence[str],
    valid_here: Iterable[str],
    model: nn.Module | Sequence[nn.Module],
    expert_names: Sequence[str],
) -> ValueError:
    """Names asked for that no layer of ``model`` has, with the names it does have."""
    hint = ""
    if any(n in expert_names for n in missing):
        hint = (
            f" {[n for n in missing if n in expert_names]} act on the expert-parallel experts: train under "
            "`MoEOverlapStrategy` (or call `apply_expert_parallel` before `apply`)."
        )
    return ValueError(
        f"{owner}: {arg} {list(missing)} are not in this model ({describe(model)}); the names present here are "
        f"{list(valid_here)}.{hint} Drop the absent names, or map them onto your layer with `register_layer_names`."
    )
