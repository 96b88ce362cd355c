"""Worker processes that exit as soon as their parent dies.

:func:`exit_with_parent` arms two guards: the Linux parent-death signal (``prctl(PR_SET_PDEATHSIG,
SIGKILL)``, only when the worker was started from its parent's main thread: the kernel ties it to the
forking thread), which works even inside C code holding the GIL; and a watchdog thread polling every
:data:`POLL_S` seconds whether the parent is gone, which needs the GIL. ``CPDataset`` arms both in every
``StatefulDataLoader`` worker; call it from a ``worker_init_fn`` for other DataLoaders.
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
    """Make the calling process die (SIGKILL) as soon as its parent process does (module docstring); False
    in a process that is not a multiprocessing child. ``deathsig=None``: when started from the parent's main
    thread, as far as the process can tell. Idempotent per process."""
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
