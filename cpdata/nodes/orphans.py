"""Worker processes that exit as soon as their parent dies.

A training process killed without a handler (SIGKILL, OOM killer) leaves its
DataLoader workers behind: torch's workers notice a dead parent only when an
index-queue read times out (5 s), and not at all while stuck in a slow read
(the issue measured 59 s). :func:`exit_with_parent` makes the calling worker
process die with its parent, two ways:

- **Parent-death signal** (Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` via
  ctypes): the kernel kills the worker the moment its parent goes, whatever
  the worker is doing (even inside C code holding the GIL). The kernel ties it
  to the parent *thread* that forked the worker, so it is armed only when that
  thread was the parent's main thread (a worker forked from a short-lived
  thread would otherwise die with that thread).
- **Watchdog thread** (everywhere): polls every :data:`POLL_S` seconds
  whether the parent is gone (``os.getppid()`` changed, or the parent's
  multiprocessing sentinel closed) and then kills its own process. Needs the
  GIL to run, so it covers pure-Python stalls and blocking I/O, not a C call
  that holds the GIL.

:class:`~cpdata.nodes.dataset.CPDataset` arms both in every ``StatefulDataLoader``
worker; call :func:`exit_with_parent` from a ``worker_init_fn`` to do the same
for other DataLoader workers. cpdata's in-process ``build_loader`` uses
threads only, which die with the process.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time

__all__ = ["POLL_S", "exit_with_parent"]

POLL_S = 0.05
"""Watchdog period: a worker outlives its parent by at most about this (plus scheduling)."""
_PR_SET_PDEATHSIG = 1
_armed: int | None = None  # pid of the process that armed (a forked child re-arms)


def _set_deathsig() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _watch(ppid: int, sentinel: int | None) -> None:
    while True:
        if sentinel is not None:
            try:
                if multiprocessing.connection.wait([sentinel], timeout=POLL_S):
                    _die()  # EOF: every write end is closed, the parent's included
            except (OSError, ValueError):
                sentinel = None
        else:
            time.sleep(POLL_S)
        if os.getppid() != ppid:
            _die()


def exit_with_parent(*, deathsig: bool | None = None, watchdog: bool = True) -> bool:
    """Make the calling process die (SIGKILL) as soon as its parent process does.

    Args:
        deathsig: arm the Linux parent-death signal; None (default) = when the
            process was started from its parent's main thread (see the module
            docstring), as far as the process can tell.
        watchdog: start the polling watchdog thread.

    Returns:
        False in a process that is not a multiprocessing child (nothing is
        armed), else True. Idempotent per process.
    """
    global _armed
    if _armed == os.getpid():
        return True
    parent = multiprocessing.parent_process()
    if parent is None:
        return False
    ppid = os.getppid()
    if deathsig is None:
        deathsig = threading.current_thread().name == "MainThread"
    if deathsig:
        _set_deathsig()
    if not parent.is_alive() or os.getppid() != ppid:
        _die()  # the parent died before the signal was armed
    if watchdog:
        sentinel = getattr(parent, "sentinel", None)
        threading.Thread(target=_watch, args=(ppid, sentinel), name="cpdata-parent-watchdog", daemon=True).start()
    _armed = os.getpid()
    return True
