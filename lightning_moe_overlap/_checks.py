"""Small predicates shared by the boundary checks (validation rules, public constructors)."""

from __future__ import annotations


def is_positive_int(value: object) -> bool:
    """An ``int`` (not a ``bool``) that is at least 1."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def is_positive_number(value: object) -> bool:
    """An ``int`` or ``float`` (not a ``bool``) above 0."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending (the valid choices a message suggests)."""
    return [d for d in range(1, n + 1) if n % d == 0]
