"""Why the run ended, said once per rank: the run-level twin of the overlap engine's failure board.

The engine's board (``overlap/failures.py``) covers failures inside a micro-batch schedule. Everything else (a rank
killed by a signal, an error in validation or in a callback, a rank that fails before its first step) leaves the
other ranks with gloo's ``Connection closed by peer`` or a timeout. Here, on the default group's c10d store:

- the launching process posts ``rank r was killed by SIGKILL`` when one of its children ends abnormally;
- a rank that fails posts ``rank r failed: <type>: <message>`` unless another rank's report is already there;
- a rank whose error follows another's reads that report and says, in one line, which rank ended it and why;
- a rank started by this package's launcher whose error is rank 0's own (the same type and message: a user error in
  ``training_step`` that every rank meets) says so in one line; rank 0 shows it in full;
- an error marked ``_checks.same_on_every_rank`` (a configuration error, found alike by every rank: the validation
  rules, the split of a batch into micro-batches) is shown once, by rank 0; the other ranks post it too (in case
  rank 0 did not find it after all) and say in one line that rank 0 shows it.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from lightning_moe_overlap.overlap.failures import _quietly, default_store, describe

NAMESPACE = "moe_overlap/exits"


class ExitBoard:
    """Exit reports of one run on a c10d store.

    Args:
        store: the store every rank reaches.
        rank: this process's global rank.
    """

    def __init__(self, store: dist.Store, rank: int) -> None:
        self.store = store
        self.rank = rank

    @classmethod
    def for_default_group(cls) -> ExitBoard | None:
        """A board on the default group's store; None without a process group."""
        if not dist.is_available() or not dist.is_initialized():
            return None
        return cls(default_store(), dist.get_rank())

    def post(self, rank: int, text: str) -> None:
        """Record why ``rank`` ended (``text`` starts after the rank: ``"failed: ValueError: ..."``)."""
        store = self.store
        _quietly(lambda: store.set(f"{NAMESPACE}/rank{rank}", text))
        _quietly(lambda: store.append(f"{NAMESPACE}/ranks", f"{rank}\n"))

    def post_failure(self, err: BaseException) -> None:
        self.post(self.rank, self.failure_text(err))

    def failure_text(self, err: BaseException) -> str:
        """What :meth:`post_failure` posts for ``err``: the same for the same error on any rank."""
        return "failed: " + describe(self.rank, err).split(": ", 1)[1]

    def report(self, rank: int, wait_s: float = 0.0, poll_s: float = 0.05) -> str | None:
        """What ``rank`` posted (``"failed: ..."``), waiting up to ``wait_s`` for it; None if nothing."""
        deadline = time.monotonic() + wait_s
        store, key = self.store, f"{NAMESPACE}/rank{rank}"
        while True:
            if _quietly(lambda: store.check([key])):
                return _quietly(lambda: store.get(key).decode())
            if time.monotonic() >= deadline:
                return None
            time.sleep(poll_s)

    def first_peer(self, wait_s: float = 0.0, poll_s: float = 0.05) -> str | None:
        """``"rank r <why>"`` for the first other rank that posted, waiting up to ``wait_s`` for one; else None."""
        deadline = time.monotonic() + wait_s
        store, key = self.store, f"{NAMESPACE}/ranks"
        while True:
            if _quietly(lambda: store.check([key])):
                posted = (_quietly(lambda: store.get(key).decode().split()) or [])
                peers = [int(r) for r in posted if int(r) != self.rank]
                if peers:
                    text = _quietly(lambda: store.get(f"{NAMESPACE}/rank{peers[0]}").decode())
                    return f"rank {peers[0]} {text or '(report unreadable)'}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(poll_s)
