"""Keep a worker's freed heap instead of handing it back to the kernel after every batch.

glibc's ``malloc`` returns the top of the heap to the kernel once more than
its trim threshold is free there, and serves allocations above its
(adaptive) mmap threshold from fresh ``mmap``s. A worker's per-batch pattern
(the batch buffer, the layout maps' temporaries, then freeing them) sits
right at those thresholds: at 32K-token packs, cp 4, a pack grows the heap by
~1.8 MB in three steps and trims it again, and the next pack pays 28-43 minor
page faults for the same memory, the kernel zeroing every page (90-125 us of
system time per pack, every layout; none at cp 8); at 128K, 36-246 faults and
60-600 us per pack (``resource.getrusage`` around two passes of the bench's
worker pipeline, 2-core CPU machine).

:func:`keep_heap` fixes both thresholds for the process (``mallopt``): blocks
below 32 MiB come from the heap and up to 64 MiB of free heap stay mapped, so
the next batch reuses warm pages: at most 1.6 faults and 7 us of system time
per pack at 8K-128K, cp 4 and 8, every layout (same measure). In a
DataLoader worker each batch also moves to a fresh shared-memory segment for
the handoff, whose pages fault in regardless (~177 at 32K, cp 4): there the
saving is 1,670-1,947 -> 722-727 faults and 4.2 -> 2.5 ms of system time per
batch at 128K, cp 4, ``thd``, but only 181-192 -> 175-180 faults at 32K.
The cost is memory the process already used: its freed heap, up to 64 MiB,
stays resident until reused (a worker's steady state is a few MB). It is
process-wide, so cpdata applies it only in processes that exist to run its
pipeline: :class:`~cpdata.nodes.dataloader.CPDataLoader`'s workers (opt out
with ``keep_heap=False``) and ``cpdata bench``. With a plain
``StatefulDataLoader`` pass ``worker_init_fn=cpdata.keep_heap``. Elsewhere
than glibc (macOS, musl) it does nothing and returns False.
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
    """Fix this process's malloc thresholds (see the module docstring); True when they were set.

    ``worker_id`` is ignored: the signature of a ``worker_init_fn``.
    """
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
