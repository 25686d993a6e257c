"""Small predicates shared by the boundary checks (validation rules, public constructors), and the mark of an error
that every rank raises alike."""

from __future__ import annotations

from typing import TypeVar

SAME_ON_EVERY_RANK = "same_on_every_rank"  # set on a raised error: every rank finds it alike, rank 0 shows it

E = TypeVar("E", bound=BaseException)


def same_on_every_rank(err: E) -> E:
    """Mark ``err`` as one that every rank raises alike (it depends only on what every rank reads alike), so that
    the launcher (``processes/exits.py``) shows it once, in full, on rank 0, and the other ranks end with one line;
    returns ``err``."""
    setattr(err, SAME_ON_EVERY_RANK, True)
    return err


def is_positive_int(value: object) -> bool:
    """An ``int`` (not a ``bool``) that is at least 1."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def is_positive_number(value: object) -> bool:
    """An ``int`` or ``float`` (not a ``bool``) above 0."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending (the valid choices a message suggests)."""
    return [d for d in range(1, n + 1) if n % d == 0]
