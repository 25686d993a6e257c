"""``compile=True``: the dense parts of every MoE block through ``torch.compile``, the experts left eager.

torchtitan compiles each transformer block whole; here a block's MoE layer holds the comm points where the overlap
engine hands the thread over to the other micro-batch (``overlap/``), the dispatchers' collectives and the
experts' deferrable weight gradients, none of which a compiled graph may swallow. So the unit is one level down:
every submodule that holds no expert-parallel experts, under a module that does (a decoder layer's attention, its
norms, its dense MLP, a Hugging Face router or shared expert; a dense layer of a model with dense layers, whole).
Not compiled: the experts and what holds them, this package's own ``TopKRouter`` (its statistics and auxiliary loss
hooks), and lone ``nn.Linear`` / ``nn.Embedding`` modules (one kernel each: nothing to fuse).

How: ``module.forward`` is replaced on the instance by ``torch.compile(module.forward)``, so the module, its
parameters, its state-dict keys and its hooks stay as they are (``torch.compile(module)`` would wrap it in a module
of its own and rename every key under ``_orig_mod``); the memory callbacks stack their wrappers on that forward
(``callbacks/_patch.py``), around the compiled call. With Dynamo's inlining of ``nn.Module`` calls (torch's
default), instances of one class share one graph: a 48-layer model compiles its attention once.

Both contexts of the overlap run compiled code (each call runs in the thread that makes it; Dynamo's frame hook is
per thread); the backward of a compiled region is AOTAutograd's, run by the autograd engine like any other node, so
the two contexts' backward and forward interleave as they do eager.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightning_moe_overlap.moe.ep import ExpertParallelExperts
from lightning_moe_overlap.moe.router import TopKRouter

COMPILED_ATTR = "_moe_overlap_compiled"  # set on each module whose forward is compiled (once)
_SKIPPED_LEAVES = (nn.Linear, nn.Embedding)
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _worth_compiling(module: nn.Module) -> bool:
    if isinstance(module, (TopKRouter, *_CONTAINERS)) or getattr(module, COMPILED_ATTR, False):
        return False
    if isinstance(module, _SKIPPED_LEAVES) and not list(module.children()):
        return False
    return any(True for _ in module.parameters())


def dense_regions(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every maximal submodule of ``root`` without expert-parallel experts whose parent holds
    some (see the module docstring), in module order; a container without experts is entered (its items are the
    candidates)."""
    found: list[tuple[str, nn.Module]] = []
    holders = _experts_holders(root)

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if id(child) in holders:
                if not isinstance(child, ExpertParallelExperts):
                    visit(f"{path}.", child)
            elif isinstance(child, _CONTAINERS):
                for item_name, item in child.named_children():
                    if _worth_compiling(item):
                        found.append((f"{path}.{item_name}", item))
            elif _worth_compiling(child):
                found.append((path, child))

    if id(root) in holders:
        visit("", root)
    return found


def _experts_holders(root: nn.Module) -> set[int]:
    """``id`` of every module of ``root`` that is or holds expert-parallel experts (one walk of the model)."""
    modules = dict(root.named_modules())
    holders: set[int] = set()
    for name, module in modules.items():
        if isinstance(module, ExpertParallelExperts):
            parts = name.split(".") if name else []
            holders.update(id(modules[".".join(parts[:i])]) for i in range(len(parts) + 1))
    return holders


def compile_dense_regions(roots: Iterable[nn.Module], **options: Any) -> list[str]:
    """Compile the forward of every dense region of ``roots`` (a model, or a pipeline rank's chunks) in place, with
    ``torch.compile``'s ``options``; returns their names (per root, joined)."""
    names: list[str] = []
    for root in roots:
        for name, module in dense_regions(root):
            module.forward = torch.compile(module.forward, **options)
            setattr(module, COMPILED_ATTR, True)
            names.append(name)
    return names
