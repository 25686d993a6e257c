"""Key adapters: which keys of a Hugging Face checkpoint fill which part of a model tensor.

A model tensor (named as the ``PreTrainedModel`` names it, with its global shape) is filled by *pieces*: a file key
and the box of the tensor it fills. A box gives each dimension of the model tensor either a range ``(start, stop)``
or an integer index, which the file tensor does not have (the dimension is squeezed). Transformers v5 holds the
experts of an MoE block fused, ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, where the Hub's files hold
one 2-D tensor per expert and projection, so::

    gate_up_proj[e, 0:I, :]  <-  experts.e.gate_proj.weight   [I, H]
    gate_up_proj[e, I:2I, :] <-  experts.e.up_proj.weight     [I, H]
    down_proj[e, :, :]       <-  experts.e.down_proj.weight   [H, I]

An :class:`HFFamily` states that mapping as data: ``renames`` (regex substitutions from the model's names to the
files'), then ``splits`` (a model tensor made of several file tensors: one per expert when the key templates hold
``{e}``, and equal parts along ``dim`` when there are several templates). A name no split matches maps to one key,
the renamed name, filling the whole tensor. The same pieces serve loading (read each key into its box) and export
(write each box under its key).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

Box = tuple["int | tuple[int, int]", ...]
"""Per model dimension: an index (squeezed in the file tensor) or a range ``(start, stop)``."""


@dataclass(frozen=True)
class Piece:
    """One file key and the box of the model tensor it fills."""

    key: str
    box: Box

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape the file tensor must have: the box's ranges, its integer dimensions squeezed."""
        return tuple(b[1] - b[0] for b in self.box if isinstance(b, tuple))

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n


@dataclass(frozen=True)
class Split:
    """A model tensor filled by several file tensors.

    Attributes:
        pattern: regex that must match the whole (renamed) model name; its named groups fill the templates.
        keys: file-key templates (``str.format`` with the named groups and ``e``, the expert index). With ``{e}``
            the model tensor's dim 0 indexes experts (one file tensor per expert, that dim squeezed); several
            templates are equal parts of the tensor along ``dim``, in order.
        dim: the model tensor's dimension the parts are concatenated along.
    """

    pattern: str
    keys: tuple[str, ...]
    dim: int = 1

    def pieces(self, match: re.Match[str], shape: tuple[int, ...]) -> list[Piece] | None:
        """The pieces of a tensor of ``shape``, or ``None`` when ``shape`` cannot be cut so (too few dimensions,
        ``shape[dim]`` not divisible by the number of parts): the caller reports it as a shape mismatch."""
        per_expert = any("{e}" in k for k in self.keys)
        parts = len(self.keys)
        needs = max(self.dim + 1 if parts > 1 else 0, 1 if per_expert else 0)  # dimensions the cut uses
        if len(shape) < needs or (parts > 1 and shape[self.dim] % parts):
            return None
        part = shape[self.dim] // parts if parts > 1 else 0
        groups = match.groupdict()
        out: list[Piece] = []
        for e in range(shape[0]) if per_expert else (None,):
            for j, template in enumerate(self.keys):
                box: list[int | tuple[int, int]] = [(0, size) for size in shape]
                if e is not None:
                    box[0] = e
                if parts > 1:
                    box[self.dim] = (j * part, (j + 1) * part)
                out.append(Piece(template.format(**groups, e=e), tuple(box)))
        return out


@dataclass(frozen=True)
class HFFamily:
    """How the files of a family of Hugging Face models name the model's tensors.

    Attributes:
        name: unique name (``family=`` of the load and export functions; shown in errors).
        model_types: the ``model_type`` values of ``config.json`` this family is picked for.
        renames: ``(regex, replacement)`` applied in order (``re.sub``) to a model name to give its file name.
        splits: model tensors made of several file tensors (matched after ``renames``).
        ties: ``(tensor, source)``: where ``config.json`` has ``tie_word_embeddings``, ``tensor`` (a model name) is
            the same tensor as ``source`` and the files hold only ``source`` (as ``save_pretrained`` writes them).
    """

    name: str
    model_types: tuple[str, ...] = ()
    renames: tuple[tuple[str, str], ...] = ()
    splits: tuple[Split, ...] = ()
    ties: tuple[tuple[str, str], ...] = (("lm_head.weight", "model.embed_tokens.weight"),)
    _compiled: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", tuple(re.compile(s.pattern) for s in self.splits))

    def file_name(self, name: str) -> str:
        """The model name after ``renames``."""
        for pattern, replacement in self.renames:
            name = re.sub(pattern, replacement, name)
        return name

    def pieces(self, name: str, shape: tuple[int, ...]) -> list[Piece] | None:
        """The pieces that fill model tensor ``name`` of global ``shape`` (``None``: a split cannot cut that
        shape)."""
        renamed = self.file_name(name)
        for split, pattern in zip(self.splits, self._compiled):
            match = pattern.fullmatch(renamed)
            if match is not None:
                return split.pieces(match, shape)
        return [whole(renamed, shape)]


def whole(key: str, shape: tuple[int, ...]) -> Piece:
    """The piece of a tensor filled by one file tensor of its own shape."""
    return Piece(key, tuple((0, size) for size in shape))


def hub_experts(gate: str, up: str, down: str) -> tuple[Split, ...]:
    """The splits of the Hub's per-expert layout: ``X.experts.{e}.{gate}`` and ``X.experts.{e}.{up}`` fill
    ``X.experts.gate_up_proj`` (gate first, along dim 1); ``X.experts.{e}.{down}`` fills ``X.experts.down_proj``."""
    return (
        Split(r"(?P<stem>.+)\.experts\.gate_up_proj", ("{stem}.experts.{e}." + gate, "{stem}.experts.{e}." + up)),
        Split(r"(?P<stem>.+)\.experts\.down_proj", ("{stem}.experts.{e}." + down,)),
    )
