"""What a dataloader worker process arms at its start: a heap it keeps, and death with its parent.

:func:`keep_heap` keeps a worker's freed heap instead of handing it back to the kernel after every batch: it
fixes glibc's mmap and trim thresholds (``mallopt``): blocks below 32 MiB come from the heap and up to 64 MiB
of free heap stay mapped, so the next batch reuses warm pages instead of faulting them in again.
Process-wide, so cpdata applies it only in ``CPDataLoader``'s workers and ``cpdata bench``; elsewhere than
glibc it does nothing. Measurements: docs/architecture.md, "Memory allocator".

:func:`exit_with_parent` makes a worker exit as soon as its parent dies. It arms two guards: the Linux
parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``, only when the worker was started from its parent's
main thread: the kernel ties it to the forking thread), which works even inside C code holding the GIL; and a
watchdog thread polling every :data:`POLL_S` seconds whether the parent is gone, which needs the GIL.
``CPDataset`` arms both in every ``StatefulDataLoader`` worker; call it from a ``worker_init_fn`` for other
DataLoaders.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

__all__ = ["MMAP_THRESHOLD", "POLL_S", "TRIM_THRESHOLD", "exit_with_parent", "keep_heap", "keeping_heap"]

MMAP_THRESHOLD = 32 << 20
"""Bytes: smaller blocks come from the heap (glibc's adaptive threshold tops out at this value)."""
TRIM_THRESHOLD = 64 << 20
"""Bytes of free heap top kept mapped before ``free`` trims it."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>


@functools.lru_cache(maxsize=1)
def _glibc_mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt`` of this process, or None where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  (glibc only; musl's mallopt is a stub that does nothing)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def keep_heap(worker_id: int | None = None) -> bool:
    """Fix this process's malloc thresholds; True when they were set (``worker_id``: a ``worker_init_fn``'s)."""
    del worker_id
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) & bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def keeping_heap(worker_init_fn: Callable[[int], object] | None) -> Callable[[int], None]:
    """A ``worker_init_fn`` that calls :func:`keep_heap`, then ``worker_init_fn`` (picklable for
    ``spawn`` workers when ``worker_init_fn`` is)."""
    return functools.partial(_init_worker, worker_init_fn)


def _init_worker(worker_init_fn: Callable[[int], object] | None, worker_id: int) -> None:
    keep_heap()
    if worker_init_fn is not None:
        worker_init_fn(worker_id)


POLL_S = 0.05
"""Watchdog period: a worker outlives its parent by at most about this (plus scheduling)."""
_PR_SET_PDEATHSIG = 1
_armed: int | None = None  # pid of the process that armed (a forked child re-arms)


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
    if deathsig and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # no prctl: the watchdog alone
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if not parent.is_alive() or os.getppid() != ppid:
        _die()  # the parent died before the signal was armed
    if watchdog:
        sentinel = getattr(parent, "sentinel", None)
        threading.Thread(target=_watch, args=(ppid, sentinel), name="cpdata-parent-watchdog", daemon=True).start()
    _armed = os.getpid()
    return True
