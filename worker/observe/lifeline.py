"""Processes never outlive their parent.

A worker child asks the kernel for a signal when its parent dies (Linux
`PR_SET_PDEATHSIG`, linux/prctl.h), so a `kill -9` of `diffq run` or `diffq worker`
leaves no worker holding a device. The signal is SIGTERM for a consuming process
(it hands back what it holds and exits, worker/delivery/celery_adapter.py) and SIGKILL for
a tensor-parallel follower, which holds nothing. The sink helper needs none: it
ends when its worker's socket closes (worker/sink/helper.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing
import os
import signal

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def parent_pid() -> int | None:
    """The pid of the process that spawned this one (None in a process not spawned
    by multiprocessing)."""
    parent = multiprocessing.parent_process()
    return parent.pid if parent is not None else None


def parent_gone() -> bool:
    expected = parent_pid()
    return expected is not None and os.getppid() != expected


def die_with_parent(signum: int = signal.SIGTERM) -> bool:
    """Deliver `signum` to this process when its parent dies. If the parent died
    before this call, it is delivered now."""
    armed = _prctl(PR_SET_PDEATHSIG, int(signum))
    if parent_gone():
        os.kill(os.getpid(), signum)
    return armed
