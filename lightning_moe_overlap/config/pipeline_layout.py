"""Which layers each pipeline chunk holds: Megatron's layout strings, the even default, and the rank of each chunk.

A model of ``num_layers`` decoder layers is cut into ``pp * vpp`` *chunks* (torch's pipelining calls them stages).
Chunk ``c`` holds a contiguous run of layers; chunk 0 also holds the embedding, the last chunk the final norm, the
head and the loss. Chunks are numbered in model order; which rank runs which chunk is the *placement*:

- ``"interleaved"`` (Megatron's interleaved assignment, torch's ``"loop"`` style, used by 1F1B, interleaved 1F1B
  and zero-bubble): virtual stage ``v`` of pp rank ``r`` is chunk ``v * pp + r``;
- ``"v"`` (DualPipeV's V shape, torch's ``"v"`` style): the chunks zigzag over the ranks, so with ``vpp=2`` rank
  ``r`` holds chunks ``r`` and ``2 * pp - 1 - r`` and rank 0 holds both the first and the last chunk.

Layout strings (Megatron's ``--pipeline-model-parallel-layout``; grammar and examples in docs/pipeline.md)::

    layout   := item*                      whitespace and ',' are ignored (',' is a visual separator)
    item     := atom ('*' N)?              N >= 1 repeats the atom N times
    atom     := 'E' | 't' | 'm' | 'L' | '|' | '(' item+ ')'

``E`` embedding, ``t`` one transformer (decoder) layer, ``m`` one multi-token-prediction layer, ``L`` final norm +
head + loss, ``|`` ends a chunk. ``"Et*3|(tt|)*29,m|L"`` is DeepSeek-V3 (61 layers + 1 MTP layer) at pp=16, vpp=2.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Placement = Literal["interleaved", "v"]
SYMBOLS = "EtmL"
PLACEMENTS: tuple[str, ...] = ("interleaved", "v")


@dataclass(frozen=True)
class Chunk:
    """One pipeline chunk.

    Attributes:
        index: position in model order (torch's stage index).
        rank: pp rank that holds the chunk.
        virtual_stage: its index among that rank's chunks.
        layers: decoder layer indices, ascending and contiguous (may be empty).
        mtp_layers: multi-token-prediction layer indices.
        embedding: holds the embedding (chunk 0).
        loss: holds the final norm, the head and the loss (the last chunk).
    """

    index: int
    rank: int
    virtual_stage: int
    layers: tuple[int, ...]
    mtp_layers: tuple[int, ...] = ()
    embedding: bool = False
    loss: bool = False

    @property
    def symbols(self) -> str:
        """The chunk as layout symbols, e.g. ``"Ettt"``."""
        return "E" * self.embedding + "t" * len(self.layers) + "m" * len(self.mtp_layers) + "L" * self.loss


@dataclass(frozen=True)
class PipelineLayout:
    """The chunks of a model over ``pp`` ranks with ``vpp`` chunks each. Build it with :func:`build_layout`."""

    pp: int
    vpp: int
    chunks: tuple[Chunk, ...]
    placement: Placement = "interleaved"

    @property
    def num_layers(self) -> int:
        return sum(len(c.layers) for c in self.chunks)

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    def chunks_of_rank(self, rank: int) -> tuple[Chunk, ...]:
        """The chunks pp rank ``rank`` holds, by virtual stage."""
        if not 0 <= rank < self.pp:
            raise ValueError(f"PipelineLayout.chunks_of_rank: rank={rank} is outside the pp group [0, {self.pp}).")
        return tuple(sorted((c for c in self.chunks if c.rank == rank), key=lambda c: c.virtual_stage))

    def to_str(self) -> str:
        """The layout as a string :func:`build_layout` reads back (runs of ``t`` written ``t*N``)."""
        return "|".join(_compress(c.symbols) for c in self.chunks)

    def table(self) -> str:
        """One line per pp rank: its chunks' indices and symbols (``lightning-moe-overlap check`` prints it)."""
        lines = []
        for rank in range(self.pp):
            cells = [f"chunk {c.index}: {_compress(c.symbols) or '(empty)'}" for c in self.chunks_of_rank(rank)]
            lines.append(f"pp rank {rank}: " + "; ".join(cells))
        return "\n".join(lines)


def _compress(symbols: str) -> str:
    t = symbols.count("t")
    return symbols.replace("t" * t, f"t*{t}") if t > 1 else symbols


# -- parsing ---------------------------------------------------------------------------------------------------
def parse_layout(text: str) -> list[str]:
    """Expand a layout string into one symbol string per chunk: ``"Et*2|(t|)*2,L"`` -> ``["Ett", "t", "t", "L"]``."""
    if not isinstance(text, str):
        raise TypeError(f"pipeline_layout must be a str, got {type(text).__name__} ({text!r}).")
    expanded, pos = _expand(text, 0, depth=0)
    if pos != len(text):  # only a stray ')' stops the top level early
        raise ValueError(
            f"pipeline_layout={text!r}: ')' at position {pos} has no matching '('. Rule: parentheses pair up. "
            "Fix: remove it or add the '(' that opens the group."
        )
    return expanded.split("|")


def _expand(text: str, pos: int, depth: int) -> tuple[str, int]:
    out: list[str] = []
    while pos < len(text):
        c = text[pos]
        if c in ", \t\n":
            pos += 1
            continue
        if c == ")":  # ends this group; at depth 0 the caller reports the stray ')'
            return "".join(out), pos
        if c == "(":
            start = pos
            atom, pos = _expand(text, pos + 1, depth + 1)
            if pos >= len(text) or text[pos] != ")":
                raise ValueError(
                    f"pipeline_layout={text!r}: '(' at position {start} is never closed. Rule: parentheses pair "
                    "up. Fix: add the ')' that ends the group, e.g. '(tt|)*2'."
                )
            if not atom:
                raise ValueError(
                    f"pipeline_layout={text!r}: the group at position {start} is empty. Rule: a group holds at "
                    "least one symbol. Fix: remove '()' or put symbols in it."
                )
            pos += 1
        elif c in SYMBOLS or c == "|":
            atom, pos = c, pos + 1
        elif c == "*":
            raise ValueError(
                f"pipeline_layout={text!r}: '*' at position {pos} repeats nothing. Rule: '*N' follows a symbol or "
                "a ')' group. Fix: write e.g. 't*4' or '(tt|)*2'."
            )
        else:
            raise ValueError(
                f"pipeline_layout={text!r}: {c!r} at position {pos} is not a layout symbol. Rule: the symbols are "
                "E (embedding), t (transformer layer), m (MTP layer), L (loss), '|' (chunk end), '(' ')' '*N' and "
                "',' (ignored). Fix: use those symbols only."
            )
        times, pos = _repeat(text, pos)
        out.append(atom * times)
    return "".join(out), pos


def _repeat(text: str, pos: int) -> tuple[int, int]:
    if pos >= len(text) or text[pos] != "*":
        return 1, pos
    end = pos + 1
    while end < len(text) and text[end].isdigit():
        end += 1
    if end == pos + 1 or int(text[pos + 1 : end]) < 1:
        raise ValueError(
            f"pipeline_layout={text!r}: '{text[pos:end + 1]}' at position {pos} is not a repeat count. Rule: '*' is "
            "followed by an integer N >= 1. Fix: write e.g. 't*3'."
        )
    return int(text[pos + 1 : end]), end


# -- building and validating -----------------------------------------------------------------------------------
def build_layout(
    num_layers: int,
    pp: int,
    vpp: int | None = None,
    layout: str | Sequence[Sequence[int]] | None = None,
    *,
    num_mtp_layers: int = 0,
    placement: Placement = "interleaved",
) -> PipelineLayout:
    """The chunks of a model with ``num_layers`` decoder layers over ``pp`` ranks of ``vpp`` chunks each.

    Args:
        num_layers: Decoder layers of the model (the entries of its ``nn.ModuleList``).
        pp: Pipeline ranks.
        vpp: Chunks per rank; ``None`` takes it from ``layout`` (chunks / pp), or 1 without a layout.
        layout: ``None`` splits the layers evenly; a layout string (module docstring); or one list of layer
            indices per chunk, in model order (the embedding goes with chunk 0, the loss with the last).
        num_mtp_layers: Multi-token-prediction layers of the model (``m`` symbols).
        placement: ``"interleaved"`` (chunk ``v * pp + r`` on rank ``r``) or ``"v"`` (DualPipeV).
    """
    _check_sizes(num_layers, pp, vpp, placement)
    if layout is None:
        chunks = _even(num_layers, pp, vpp or 1)
    elif isinstance(layout, str):
        chunks = parse_layout(layout)
    else:
        chunks = _from_indices(layout, num_layers)
    vpp = _check_count(chunks, layout, pp, vpp)
    if placement == "v" and vpp % 2:
        raise ValueError(
            f"placement='v' with vpp={vpp}: the V shape goes down the ranks and back up. Rule: placement 'v' needs "
            "an even vpp (DualPipeV: vpp=2). Fix: vpp=2, or placement='interleaved'."
        )
    where = f"pipeline_layout={layout!r}" if layout is not None else "the even split"
    ranks = _ranks(pp, len(chunks), placement)
    _check_symbols(chunks, where, num_layers)
    _check_mtp(chunks, where, num_mtp_layers, [v == vpp - 1 for _, v in ranks])
    return PipelineLayout(pp, vpp, _number(chunks, ranks), placement)


def _check_sizes(num_layers: int, pp: int, vpp: int | None, placement: str) -> None:
    for name, value in (("num_layers", num_layers), ("pp", pp), ("vpp", 1 if vpp is None else vpp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"build_layout: {name}={value!r}. Rule: an integer >= 1. Fix: pass a positive int.")
    if placement not in PLACEMENTS:
        raise ValueError(
            f"build_layout: placement={placement!r} is not one of {PLACEMENTS}. Fix: 'interleaved' for 1F1B, "
            "interleaved 1F1B and zero-bubble schedules, 'v' for DualPipeV."
        )


def _even(num_layers: int, pp: int, vpp: int) -> list[str]:
    n = pp * vpp
    if num_layers % n:
        raise ValueError(
            f"num_layers={num_layers} does not split evenly into pp * vpp = {pp} * {vpp} = {n} chunks. Rule: "
            f"without pipeline_layout every chunk gets num_layers / (pp * vpp) layers. Fix: pass "
            f"pipeline_layout={suggest_layout(num_layers, n)!r} (or another layout), or change pp / vpp."
        )
    per = num_layers // n
    return ["E" * (c == 0) + "t" * per + "L" * (c == n - 1) for c in range(n)]


def suggest_layout(num_layers: int, num_chunks: int) -> str:
    """A layout giving the leftover layers of an uneven split to the middle chunks (lighter first/last chunks)."""
    per, extra = divmod(num_layers, num_chunks)
    counts = [per] * num_chunks
    order = list(range(1, num_chunks - 1)) + [0, num_chunks - 1]  # the middle first: the ends carry E and L
    for c in order[:extra]:
        counts[c] += 1
    return "|".join(_compress("E" * (c == 0) + "t" * k + "L" * (c == num_chunks - 1)) for c, k in enumerate(counts))


def _from_indices(layout: Sequence[Sequence[int]], num_layers: int) -> list[str]:
    flat = [i for chunk in layout for i in chunk]
    if flat != list(range(num_layers)):
        raise ValueError(
            f"pipeline_layout={[list(c) for c in layout]!r} does not hold layers 0..{num_layers - 1} once each and "
            "in order. Rule: chunks are contiguous runs of the layers in model order. Fix: list every layer "
            "index exactly once, ascending, e.g. [[0, 1], [2, 3]]."
        )
    n = len(layout)
    return ["E" * (c == 0) + "t" * len(chunk) + "L" * (c == n - 1) for c, chunk in enumerate(layout)]


def _check_count(chunks: list[str], layout: object, pp: int, vpp: int | None) -> int:
    if vpp is None:
        if len(chunks) % pp:
            raise ValueError(
                f"pipeline_layout={layout!r} has {len(chunks)} chunks, not a multiple of pp={pp}. Rule: every pp "
                f"rank holds the same number of chunks (vpp = chunks / pp). Fix: write a multiple of {pp} chunks "
                "('|' ends a chunk)."
            )
        return len(chunks) // pp
    if len(chunks) != pp * vpp:
        raise ValueError(
            f"pipeline_layout={layout!r} has {len(chunks)} chunks but pp * vpp = {pp} * {vpp} = {pp * vpp}. Rule: "
            "one chunk per virtual stage ('|' ends a chunk). Fix: write pp * vpp chunks, or set vpp = "
            f"{len(chunks)} / pp."
        )
    return vpp


def _check_symbols(chunks: list[str], where: str, num_layers: int) -> None:
    flat = "".join(chunks)
    if not chunks[0].startswith("E") or flat.count("E") != 1:
        raise ValueError(
            f"{where}: chunks {chunks}. Rule: 'E' (embedding) appears once, first in chunk 0, which is fed the "
            "token ids. Fix: start the layout with 'E' and use it nowhere else."
        )
    if not chunks[-1].endswith("L") or flat.count("L") != 1:
        raise ValueError(
            f"{where}: chunks {chunks}. Rule: 'L' (norm, head, loss) appears once, last in the last chunk. Fix: "
            "end the layout with 'L' and use it nowhere else."
        )
    if flat.count("t") != num_layers:
        raise ValueError(
            f"{where} has {flat.count('t')} 't' (transformer layers) but the model has num_layers={num_layers}. "
            "Rule: every decoder layer is in exactly one chunk. Fix: write one 't' per layer."
        )


def _check_mtp(chunks: list[str], where: str, num_mtp_layers: int, last_virtual: list[bool]) -> None:
    flat = "".join(chunks)
    if flat.count("m") != num_mtp_layers:
        raise ValueError(
            f"{where} has {flat.count('m')} 'm' (MTP layers) but the model has num_mtp_layers={num_mtp_layers}. "
            "Rule: one 'm' per multi-token-prediction layer. Fix: write that many 'm', or none for a model "
            "without MTP layers."
        )
    if not num_mtp_layers:
        return
    holders = [c for c, s in enumerate(chunks) if "m" in s]
    if "t" in flat[flat.index("m") :] or len(holders) > 1:
        raise ValueError(
            f"{where}: chunks {chunks}. Rule (Megatron): the MTP layers follow every decoder layer, all in one "
            "chunk. Fix: put all 'm' together after the last 't', e.g. '...|tt|m|L'."
        )
    if not last_virtual[holders[0]]:
        raise ValueError(
            f"{where}: the MTP layers are in chunk {holders[0]}, not the last virtual stage of its rank. Rule "
            "(Megatron): MTP layers sit in a rank's last chunk. Fix: move the 'm' into one of the last pp chunks."
        )


def _ranks(pp: int, num_chunks: int, placement: str) -> list[tuple[int, int]]:
    """(rank, virtual stage) of each chunk."""
    if placement == "interleaved":
        return [(c % pp, c // pp) for c in range(num_chunks)]
    out = []
    for c in range(num_chunks):
        v, i = divmod(c, pp)
        out.append((i if v % 2 == 0 else pp - 1 - i, v))  # down the ranks, then back up
    return out


def _number(chunks: list[str], ranks: list[tuple[int, int]]) -> tuple[Chunk, ...]:
    out, layer, mtp = [], 0, 0
    for c, (symbols, (rank, v)) in enumerate(zip(chunks, ranks)):
        t, m = symbols.count("t"), symbols.count("m")
        out.append(
            Chunk(
                index=c, rank=rank, virtual_stage=v, layers=tuple(range(layer, layer + t)),
                mtp_layers=tuple(range(mtp, mtp + m)), embedding="E" in symbols, loss="L" in symbols,
            )
        )
        layer, mtp = layer + t, mtp + m
    return tuple(out)
