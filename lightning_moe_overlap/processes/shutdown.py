"""Destroy the process groups when the rank's interpreter exits, before it starts tearing itself down.

A gloo worker thread can still hold the last reference to a finished collective's tensors when the rank's main
thread returns (the usual case: a rank that sends its last ``gather`` and exits at once, as the ``spawn`` workers
do). Dropping a tensor that Python has seen takes the GIL, and a thread that asks for the GIL while the interpreter
finalizes ends the process with SIGABRT ("terminate called without an active exception"). Lightning destroys the
group at exit only for NCCL; this does it for every backend, from an ``atexit`` handler, which runs while the
interpreter is still whole: destroying the groups gives up the GIL, so the worker threads finish first.
"""

from __future__ import annotations

import atexit

import torch.distributed as dist


def destroy_process_groups_at_exit() -> None:
    """Register the exit handler once per process (registering again moves it, it does not add a second)."""
    atexit.unregister(_destroy_process_groups)
    atexit.register(_destroy_process_groups)


def _destroy_process_groups() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
