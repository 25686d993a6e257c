"""``Registry``: named entries, built-in ones fixed at creation and user ones added and removed at run time.

Two registries use it: the experts adapters (``moe/adapters.py``: which modules are experts and how they store
their weights) and the layer names of the memory callbacks (``callbacks/layer_specs.py``: what ``"core_attn"`` or
``"moe_act"`` means in a kind of decoder layer).

Scope: one registry per kind, process-wide, as Lightning's strategy and accelerator registries and torch's
operator registrations are. An entry states a fact about a *type* of module (this class stores its experts so;
this layer calls its attention that), not a setting of one run, so it holds for every strategy and callback in
the process. And it must be made where the user's code is imported: the strategy re-runs the script (``popen``)
or pickles the trainer into new processes (``spawn``), and a registration at import time reaches both, while an
instance handed to one strategy would have to travel with it. Per-run choices stay arguments of the strategy and
callbacks.

Temporary entries (tests, notebooks trying an adapter) go through :meth:`Registry.scoped`, which restores the user
entries on exit; the test suite wraps every test in it, so no test sees another's registrations.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, Protocol, TypeVar


class Named(Protocol):
    @property
    def name(self) -> str: ...


T = TypeVar("T", bound=Named)


class Registry(Generic[T]):
    """Entries with unique ``name``s: ``builtin`` ones (fixed) and user ones in registration order.

    Args:
        noun: what an entry is, in messages (``"adapter"``, ``"spec"``).
        builtin: the built-in entries, which cannot be removed.
        functions: the public functions that add and remove entries, named in messages.
    """

    def __init__(self, noun: str, builtin: tuple[T, ...], functions: tuple[str, str]) -> None:
        self.noun, self.builtin = noun, builtin
        self._register_fn, self._unregister_fn = functions
        self._user: list[T] = []

    @property
    def user(self) -> tuple[T, ...]:
        """User entries, oldest first."""
        return tuple(self._user)

    def names(self) -> list[str]:
        return [e.name for e in (*self.builtin, *self._user)]

    def add(self, entry: T, *, fix: str) -> T:
        """Append ``entry``; ``ValueError`` (ending with ``fix``) when its name is taken."""
        name = entry.name
        if name in self.names():
            article = "an" if self.noun[:1] in "aeiou" else "a"
            raise ValueError(
                f"`{self._register_fn}`: {article} {self.noun} named {name!r} is already registered; names must be "
                f"unique. {fix}"
            )
        self._user.append(entry)
        return entry

    def remove(self, name: str) -> T:
        """Remove the user entry called ``name``; built-in entries cannot be removed."""
        for i, entry in enumerate(self._user):
            if entry.name == name:
                return self._user.pop(i)
        raise ValueError(
            f"`{self._unregister_fn}`: no user {self.noun} named {name!r}; registered: "
            f"{[e.name for e in self._user]}. Built-in {self.noun}s cannot be removed."
        )

    @contextmanager
    def scoped(self) -> Iterator[Registry[T]]:
        """Entries added (or removed) inside the block are undone on exit."""
        saved = list(self._user)
        try:
            yield self
        finally:
            self._user[:] = saved
