"""Count ``torch.distributed`` collectives by instrumenting them, not by assumption.

:class:`CollectiveCounter` wraps every collective of ``torch.distributed`` (and of extra modules that bound
them by name) and counts *outermost* calls, so one built on another counts once; only calls between
``start()`` and ``stop()`` count.
"""

from __future__ import annotations

import collections
import functools
import types
from collections.abc import Iterable

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["COLLECTIVES", "CollectiveCounter"]

COLLECTIVES: tuple[str, ...] = (
    "all_gather", "all_gather_coalesced", "all_gather_into_tensor", "all_gather_object", "all_gather_single",
    "all_reduce", "all_reduce_coalesced", "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv",
    "broadcast", "broadcast_object_list", "gather", "gather_object", "irecv", "isend", "monitored_barrier",
    "recv", "recv_object_list", "reduce", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor",
    "scatter", "scatter_object_list", "send", "send_object_list",
)  # fmt: skip


class CollectiveCounter:
    """Context manager: ``with CollectiveCounter() as c: c.start(); ...; c.stop(); c.counts``."""

    def __init__(self, extra_modules: Iterable[types.ModuleType] = ()) -> None:
        self._modules = [dist, c10d, *extra_modules]
        self._saved: list[tuple[types.ModuleType, str, object]] = []
        self._depth = 0
        self._active = False
        self.counts: collections.Counter[str] = collections.Counter()

    def _wrap(self, name: str, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if self._active and self._depth == 0:
                self.counts[name] += 1
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def __enter__(self) -> CollectiveCounter:
        originals = {name: getattr(c10d, name) for name in COLLECTIVES if hasattr(c10d, name)}
        for module in self._modules:
            for name, fn in originals.items():
                if getattr(module, name, None) is fn:
                    self._saved.append((module, name, fn))
                    setattr(module, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc) -> None:
        for module, name, fn in reversed(self._saved):
            setattr(module, name, fn)
        self._saved.clear()

    def start(self) -> None:
        """Zero the counts and start counting."""
        self.counts.clear()
        self._active = True

    def stop(self) -> dict[str, int]:
        """Stop counting; return the counts by collective name."""
        self._active = False
        return dict(self.counts)
