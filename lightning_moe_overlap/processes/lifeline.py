"""Every rank the launcher started ends when the job ends, whatever state it is in.

Two mechanisms, one per side:

- **in each child** (Linux): ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` asks the kernel to kill the child when the
  launching process exits, however it exits (an exception, SIGKILL, the out-of-memory killer). A hung rank that
  ignores SIGTERM dies with its launcher instead of holding its device as an orphan;
- **in the launching process**: a :class:`ChildReaper` watches the children. It reports a child that ended
  abnormally (once, with its exit code or signal) and, when the launching process fails or exits, gives the
  children a grace period to end by themselves, then sends SIGTERM, then SIGKILL to those still running.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
LAUNCHER_PID_ENV = "LIGHTNING_MOE_OVERLAP_LAUNCHER_PID"  # set only in the environment of launched children


def die_with_parent(parent_pid: int) -> bool:
    """Arm SIGKILL on the death of ``parent_pid`` (this process's parent); False where the OS has no such signal.

    If the parent is already gone when this runs (it died between the fork and this call), the signal would never
    come, so the process kills itself at once: the job it belonged to has ended.
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def describe_exit(returncode: int) -> str:
    """``"was killed by SIGKILL"`` or ``"exited with code 3"``: why a process ended, from its return code."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


class ChildReaper:
    """Watches the children of the launching process and ends them when it must.

    Args:
        procs: the children, ``procs[i]`` being local rank ``i + 1``.
        on_abnormal_exit: called once per child that ends with a non-zero code, with its local rank and code
            (from the watching thread).
        poll_s: how often the watching thread polls the children.
        term_grace_s: how long a child has between SIGTERM and SIGKILL.
    """

    def __init__(
        self,
        procs: list[subprocess.Popen],
        on_abnormal_exit: Callable[[int, int], None],
        *,
        poll_s: float = 0.1,
        term_grace_s: float = 3.0,
    ) -> None:
        self.procs = procs
        self.on_abnormal_exit = on_abnormal_exit
        self.poll_s = poll_s
        self.term_grace_s = term_grace_s
        self._reported: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="moe-overlap-child-reaper", daemon=True)

    def start(self) -> ChildReaper:
        self._thread.start()
        return self

    def alive(self) -> list[subprocess.Popen]:
        return [p for p in self.procs if p.poll() is None]

    def _check(self) -> bool:
        """Report children that ended abnormally since the last check; True once every child has ended."""
        with self._lock:
            for local_rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code not in (None, 0) and local_rank not in self._reported:
                    self._reported.add(local_rank)
                    self.on_abnormal_exit(local_rank, code)
            return all(p.returncode is not None for p in self.procs)

    def _watch(self) -> None:
        while not self._stop.is_set():
            if self._check():
                return
            self._stop.wait(self.poll_s)

    def reap(self, grace_s: float) -> dict[int, str]:
        """Wait up to ``grace_s`` for the children to end, then SIGTERM, then SIGKILL the rest. Idempotent.

        Returns ``{local_rank: name of the last signal sent}`` for the children it had to end."""
        sent: dict[int, str] = {}
        deadline = time.monotonic() + grace_s
        while self.alive() and time.monotonic() < deadline:
            time.sleep(self.poll_s)
        for sig, wait_s in ((signal.SIGTERM, self.term_grace_s), (signal.SIGKILL, self.term_grace_s)):
            running = self.alive()
            if not running:
                break
            for proc in running:
                proc.send_signal(sig)
                sent[self.procs.index(proc) + 1] = sig.name
            deadline = time.monotonic() + wait_s
            while self.alive() and time.monotonic() < deadline:
                time.sleep(self.poll_s)
        self._check()
        self._stop.set()
        return sent
