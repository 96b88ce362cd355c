"""Keep a worker's freed heap instead of handing it back to the kernel after every batch.

:func:`keep_heap` fixes glibc's mmap and trim thresholds (``mallopt``): blocks below 32 MiB come from the
heap and up to 64 MiB of free heap stay mapped, so the next batch reuses warm pages instead of faulting
them in again. Process-wide, so cpdata applies it only in ``CPDataLoader``'s workers and ``cpdata bench``;
elsewhere than glibc it does nothing. Measurements: docs/architecture.md, "Memory allocator".
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_heap", "keeping_heap"]

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
