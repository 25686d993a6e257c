"""A ``DataLoader`` that resumes where its epoch stopped: the batches a checkpoint's run had drawn are not drawn again.

Lightning saves the state of a training dataloader that has ``state_dict`` / ``load_state_dict`` with each
checkpoint and hands it back on resume; a plain ``DataLoader`` has none, so a resume from a checkpoint saved inside
an epoch starts that epoch's batches again from the first one (Lightning warns "your dataloader is not resumable").
:class:`ResumableDataLoader` is a ``DataLoader`` with that state: the number of batches its current pass has
yielded. After ``load_state_dict`` the next pass skips that many, so the resumed run sees the batches the unbroken
run saw next. The order of a pass must be the same in both runs: a sampler whose order is a function of its seed and
epoch (Lightning's ``DistributedSampler``, which it puts in under a multi-process strategy; ``shuffle=False``), not
one drawing from a generator whose state the checkpoint does not hold.

The skipped batches are read and dropped (no step runs on them): a resume costs the reading of the part of the
epoch already done. A saved position at or past the end of the pass (a checkpoint of an epoch's end) starts a fresh
pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader


class ResumableDataLoader(DataLoader):
    """``torch.utils.data.DataLoader`` (the same arguments) whose position in the current pass is saved with
    Lightning's checkpoints and restored on resume (docs/checkpoints.md, "Exact resume")."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._moe_position = 0  # batches the current pass has yielded
        self._moe_skip = 0  # batches the next pass skips (set by `load_state_dict`)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        skip, self._moe_skip = self._moe_skip, 0
        self._moe_position = 0
        return self._pass(super().__iter__(), skip)

    def _pass(self, batches: Iterator[Any], skip: int) -> Iterator[Any]:
        try:
            length = len(self)
        except TypeError:  # an iterable dataset without a length
            length = None
        if length is not None and skip >= length:
            skip = 0  # saved at the end of a pass: a fresh one
        for _ in range(skip):
            next(batches, None)
        self._moe_position = skip
        for batch in batches:
            self._moe_position += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        """``{"batches": n}``: the batches the current pass has yielded."""
        return {"batches": self._moe_position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """The next pass skips ``state["batches"]`` batches.

        Raises:
            ValueError: ``state`` is not what :meth:`state_dict` returns.
        """
        batches = state.get("batches") if isinstance(state, dict) else None
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 0:
            raise ValueError(
                f"`ResumableDataLoader.load_state_dict`: got {state!r}; expected {{'batches': n}} with n >= 0, as "
                "`state_dict` returns. Resume from a checkpoint that a run with a `ResumableDataLoader` saved."
            )
        self._moe_skip = batches


__all__ = ["ResumableDataLoader"]
